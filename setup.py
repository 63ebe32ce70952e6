"""Package layout only; metadata lives in pyproject.toml.

The design card asks for agent/, trainer/, alerts/ and dashboards/ at the top of the repository. They are
installed as subpackages of `trainguard` so that nothing as generic as `agent` lands in site-packages.
The trainguard/ folder is the core and imports none of agent/, trainer/, protect/ or preflight/
(docs/architecture.md, "Layers"; tests/test_layers.py).
"""
from setuptools import find_packages, setup

ROOTS = {
    "trainguard": "trainguard",
    "trainguard.agent": "agent",
    "trainguard.trainer": "trainer",
    "trainguard.protect": "protect",
    "trainguard.preflight": "preflight",
    "trainguard.alerts": "alerts",
    "trainguard.dashboards": "dashboards",
}

packages, package_dir = [], {}
for name, folder in ROOTS.items():
    package_dir[name] = folder
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
