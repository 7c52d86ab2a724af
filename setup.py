"""Maps the repository's top-level folders to their import names.

pyproject.toml holds all metadata; this file exists only because setuptools cannot
express "every sub-package of folder X, installed under import name Y" declaratively.
"""

from setuptools import find_packages, setup

# import name -> folder in this repository
ROOTS = {
    "ninfer": "ninfer",
    "ninfer_plugins": "plugins",
    "ninfer_kernels": "kernels",
    "ninfer_configs": "configs",
}

packages = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=ROOTS)
