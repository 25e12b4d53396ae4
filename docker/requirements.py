"""Print the farm image's Python requirements, one per line, from pyproject.toml.

They are the farm's pinned dependencies, with Ray's `default` extra (its metrics agent serves
`ray start --metrics-export-port`, which Prometheus scrapes), and the build backend that installs
the farm itself (`pip install --no-build-isolation`). docker/Dockerfile installs them, and
docker/offline/prepare.sh builds the wheelhouse of an offline build from the same list.
Usage: python3 docker/requirements.py [pyproject.toml]
"""

import re
import sys
import tomllib


def requirements(pyproject: dict) -> list[str]:
    """The image's requirements from a parsed pyproject.toml, in its order, build backend last."""
    deps = [re.sub(r"^ray(?=[=<>~! ])", "ray[default]", dep) for dep in pyproject["project"]["dependencies"]]
    return deps + list(pyproject["build-system"]["requires"])


if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml", "rb") as f:
        print("\n".join(requirements(tomllib.load(f))))
