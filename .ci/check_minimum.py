"""Check that `.ci/minimum.txt` pins each dependency of `pyproject.toml` that has a
lower bound to exactly that bound, so that CI's second run tests the oldest versions
the project declares. Exits non-zero, naming the mismatches, otherwise."""

import pathlib
import re
import sys
import tomllib


ROOT = pathlib.Path(__file__).parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower()


def main() -> int:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lower = {}
    for requirement in project["dependencies"]:
        match = re.search(r">=\s*([\w.]+)", requirement)
        if match:
            lower[_name(requirement)] = match.group(1)
    pins = {}
    for line in (ROOT / ".ci" / "minimum.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_name(name)] = version.strip()
    wrong = [
        f"{name}: pyproject.toml says >={bound}, .ci/minimum.txt pins "
        f"{pins.get(name, 'nothing')}"
        for name, bound in lower.items()
        if pins.get(name) != bound
    ]
    for line in wrong:
        print(line, file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
