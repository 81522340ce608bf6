"""The optional C part: shmcancel.shm._cwrite, a table's common write in C (see its source).
Where it cannot be built (no compiler, no Python headers) the install goes on without it and
every write takes the Python path, which stores the same bytes."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shmcancel.shm._cwrite", ["src/shmcancel/shm/_cwrite.c"],
                             optional=True, extra_compile_args=["-O2"])])
