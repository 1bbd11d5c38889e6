"""Packaging beside pyproject.toml for one thing pyproject cannot say: the Hydra configs.

``conf/`` (with ``conf/recipe``, a link to the top-level ``recipes/``) stays at the top of the
repository and ships inside the wheel as ``lightning_twobp/configs/``, where twobp-train and
twobp-plan find them after a regular ``pip install``.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["lightning_twobp", "lightning_twobp.*"]), "lightning_twobp.configs"],
    package_dir={"lightning_twobp.configs": "conf"},
    package_data={"lightning_twobp.configs": ["*.yaml", "*.md", "*/*.yaml"]},
)
