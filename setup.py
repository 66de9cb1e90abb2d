"""Package discovery only (metadata lives in pyproject.toml).

The three components sit at the top of the repo as peers, `operator/`, `extender/` and
`deviceplugin/`, and install as `carpool.operator`, `carpool.extender` and
`carpool.deviceplugin`. None of the three folders has an `__init__.py`: a folder named like a
standard-library module (`operator`) must never be a regular package, or running Python from
the repo root would shadow the standard library. They install as namespace sub-packages of
`carpool`; setuptools' declarative `find` cannot rename folders, so they are listed here.
"""

from setuptools import find_namespace_packages, find_packages, setup

COMPONENTS = ("operator", "extender", "deviceplugin")


def mapped(folder: str) -> list[str]:
    package = f"carpool.{folder}"
    subs = find_namespace_packages(folder, exclude=["__pycache__", "*.__pycache__"])
    return [package] + [f"{package}.{sub}" for sub in subs]


setup(
    packages=find_packages("src") + [p for folder in COMPONENTS for p in mapped(folder)],
    package_dir={"carpool": "src/carpool", **{f"carpool.{c}": c for c in COMPONENTS}},
)
