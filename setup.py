"""Maps runtime/, snapshot/ and gateway/ into the one `ember` namespace (see docs/design.md)."""
from setuptools import find_packages, setup

ROOTS = {"ember": "ember", "ember.runtime": "runtime", "ember.snapshot": "snapshot", "ember.gateway": "gateway"}


def packages() -> tuple[list[str], dict[str, str]]:
    names, dirs = [], {}
    for name, folder in ROOTS.items():
        names.append(name)
        dirs[name] = folder
        for sub in find_packages(folder):
            names.append(f"{name}.{sub}")
            dirs[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
    return names, dirs


names, dirs = packages()
setup(packages=names, package_dir=dirs, package_data={"ember.gateway": ["static/*"]})
