"""Builds rollout_corr_ext._C: CPU kernels always; CUDA kernels when torch is a CUDA build, nvcc is found and a
GPU is visible or FORCE_CUDA=1 (archs from TORCH_CUDA_ARCH_LIST, default "8.0;9.0+PTX"; MAX_JOBS honoured).

Install with `pip install --no-build-isolation -e .` in an environment that already has torch.
"""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent

# Load the shared source list without importing the package (its __init__ imports the built module).
_spec = importlib.util.spec_from_file_location("_rc_build", Path(__file__).parent / "rollout_corr_ext" / "_build.py")
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402
except ImportError:
    sys.exit("rollout_corr_ext: building the extension needs torch in the build environment, and pip's build "
             "isolation hides it. Install torch first, then build without isolation: "
             "`pip install --no-build-isolation .` (or `python -m build --no-isolation`).")


class BuildPyWithSources(build_py):
    """Also copies csrc/ into the built package, so that load_extension() can JIT-compile from a wheel install."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            dest = Path(self.build_lib) / "rollout_corr_ext" / "csrc"
            shutil.rmtree(dest, ignore_errors=True)  # a file an earlier build copied must not outlive its source
            shutil.copytree(HERE / "csrc", dest)


class BuildExtRecordingSources(BuildExtension.with_options(use_ninja=True)):
    """Writes the hash of the sources it compiled beside each module it built (``<module file>.sources``, in the
    build folder and, for in-place and editable builds, in the tree): the package refuses at import a module whose
    sources differ from its csrc/ (rollout_corr_ext/__init__.py)."""

    def run(self):
        super().run()
        digest = _build.source_hash(HERE / "csrc")
        inplace, built = self.inplace, set()
        for flag in {False, bool(inplace)}:
            self.inplace = flag
            built.update(Path(self.get_ext_fullpath(ext.name)) for ext in self.extensions)
        self.inplace = inplace
        for module in built:
            if module.is_file():
                module.with_name(module.name + _build.SOURCES_SUFFIX).write_text(digest + "\n")


if _build.skip_build():
    # The Python package alone: scripts/bootstrap.sh installs it editable this way, then compiles with
    # `setup.py build_ext --inplace`, whose objects in build/ a later wheel build reuses (ninja).
    print("rollout_corr_ext: ROLLOUT_CORR_SKIP_BUILD=1, the extension is not compiled")
    setup(cmdclass={"build_py": BuildPyWithSources})
else:
    with_cuda = _build.want_cuda()
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _build.DEFAULT_CUDA_ARCHS)
    kwargs = _build.extension_kwargs(with_cuda)
    Extension = CUDAExtension if with_cuda else CppExtension
    print(f"rollout_corr_ext: building {'CPU + CUDA' if with_cuda else 'CPU'} kernels"
          + (f" for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}" if with_cuda else ""))
    setup(
        ext_modules=[Extension("rollout_corr_ext._C", py_limited_api=False, **kwargs)],
        cmdclass={"build_ext": BuildExtRecordingSources, "build_py": BuildPyWithSources},
    )
