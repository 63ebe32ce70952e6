"""Package layout only; metadata lives in pyproject.toml.

The design card asks for agent/, trainer/, alerts/ and dashboards/ at the top of the repository. They are
installed as subpackages of `trainguard` so that nothing as generic as `agent` lands in site-packages.
"""
from setuptools import find_packages, setup

ROOTS = {
    "trainguard": "trainguard",
    "trainguard.agent": "agent",
    "trainguard.trainer": "trainer",
    "trainguard.protect": "protect",
    "trainguard.alerts": "alerts",
    "trainguard.dashboards": "dashboards",
}

packages, package_dir = [], {}
for name, folder in ROOTS.items():
    package_dir[name] = folder
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
