"""Package layout only; metadata lives in pyproject.toml.

The design card asks for agent/, trainer/, alerts/ and dashboards/ at the top of the repository. They, and
runtime/, protect/, preflight/ and demo/, are installed as subpackages of `trainguard` so that nothing as
generic as `agent` lands in site-packages. Each imports only the packages it is built on; the trainguard/
folder is the core and imports none of them (docs/architecture.md, "Layers"; tests/test_layers.py, which
reads ROOTS below: a package added here needs its row there).
"""
from setuptools import find_packages, setup

ROOTS = {
    "trainguard": "trainguard",
    "trainguard.runtime": "runtime",
    "trainguard.agent": "agent",
    "trainguard.trainer": "trainer",
    "trainguard.protect": "protect",
    "trainguard.preflight": "preflight",
    "trainguard.alerts": "alerts",
    "trainguard.dashboards": "dashboards",
    "trainguard.demo": "demo",
}

packages, package_dir = [], {}
for name, folder in ROOTS.items():
    package_dir[name] = folder
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
