"""Packaging hook (everything else is in pyproject.toml): the shipped checkpoint goes into the
wheel as package data of `engine`, at engine/tiny-moe/, where `engine.config.SHIPPED_MODEL`
finds it in an installed copy.  Its one home in the source tree stays models/tiny-moe/ (an
editable install and a plain checkout read it there)."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CHECKPOINT = Path(__file__).resolve().parent / "models" / "tiny-moe"
INSTALLED_AT = ("engine", "tiny-moe")     # engine.config.SHIPPED_MODEL's installed location


class BuildWithCheckpoint(build_py):
    """build_py, plus the checkpoint's files copied under build_lib/engine/tiny-moe/."""

    def _checkpoint_files(self) -> list[tuple[Path, Path]]:
        if getattr(self, "editable_mode", False):
            return []                         # the checkout's models/tiny-moe is used in place
        target = Path(self.build_lib).joinpath(*INSTALLED_AT)
        return [(f, target / f.name) for f in sorted(CHECKPOINT.iterdir()) if f.is_file()]

    def run(self) -> None:
        super().run()
        files = self._checkpoint_files()
        if files and not (CHECKPOINT / "config.json").is_file():
            raise FileNotFoundError(f"{CHECKPOINT} has no config.json: the shipped checkpoint is missing")
        for src, dst in files:
            self.mkpath(str(dst.parent))
            self.copy_file(str(src), str(dst))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), *(str(dst) for _, dst in self._checkpoint_files())]


setup(cmdclass={"build_py": BuildWithCheckpoint})
