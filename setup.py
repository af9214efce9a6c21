"""Build hook: regenerate the gRPC code (protos/specdec/v1/*.proto -> specdec/v1/) before the
package is built. Everything else about the package is in pyproject.toml.

`build_protos` runs `protos/generate.py` in place. It is the first sub-command of `build`, which
covers wheels (`pip install .`, `python -m build`) and editable installs (setuptools' editable_wheel
runs the `build` sub-commands too, `build_py` in editable mode), and `build_py` runs it as well for
direct `setup.py build_py` calls; setuptools runs it at most once per build.

pip's isolated builds install the pinned grpcio-tools from [build-system] requires, so they
regenerate, and only files whose bytes change are rewritten. The generated modules are committed,
so a build without protos/ (from an sdist) or without the pinned grpcio-tools
(`--no-build-isolation` in an environment that lacks it) keeps the committed ones and says so.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
GENERATOR = ROOT / "protos" / "generate.py"


def _load_generator():
    spec = importlib.util.spec_from_file_location("specdec_protos_generate", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class build_protos(Command):  # noqa: N801 (setuptools command names are lower case)
    description = "regenerate specdec/v1/ from protos/ (python protos/generate.py)"
    user_options: list = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        if not GENERATOR.exists():
            self.announce("protos/generate.py not found: keeping the committed specdec/v1/", logging.WARNING)
            return
        generator = _load_generator()
        installed = generator.installed_grpcio_tools_version()
        if installed != generator.GRPCIO_TOOLS_VERSION:
            self.announce(f"grpcio-tools {installed or 'is not installed'} (the pin is "
                          f"{generator.GRPCIO_TOOLS_VERSION}): keeping the committed specdec/v1/",
                          logging.WARNING)
            return
        changed = generator.generate(ROOT)  # a broken .proto fails the build here
        for path in changed:
            self.announce(f"regenerated {path.relative_to(ROOT)}", logging.INFO)
        if not changed:
            self.announce("specdec/v1/ is up to date with protos/", logging.INFO)


class build_with_protos(build):  # noqa: N801
    sub_commands = [("build_protos", None), *build.sub_commands]


class build_py_with_protos(build_py):  # noqa: N801
    def run(self) -> None:
        self.run_command("build_protos")
        super().run()


setup(cmdclass={"build": build_with_protos, "build_py": build_py_with_protos, "build_protos": build_protos})
