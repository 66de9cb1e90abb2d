"""Package discovery only (metadata lives in pyproject.toml).

`operator/` and `deviceplugin/` sit at the top of the repo but install as `carpool.operator`
and `carpool.deviceplugin`; setuptools' declarative `find` cannot rename folders, so their
sub-packages are listed here.
"""

from setuptools import find_packages, setup


def mapped(folder: str, package: str) -> list[str]:
    return [package] + [f"{package}.{sub}" for sub in find_packages(folder)]


setup(
    packages=find_packages("src")
    + mapped("operator", "carpool.operator")
    + mapped("deviceplugin", "carpool.deviceplugin")
    + ["carpool.crd_manifests"]  # crds/*.yaml, data only (carpool.crds loads them)
)
