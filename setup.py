"""The C extensions of rlstream's record path (everything else is in pyproject.toml).

Both are optional: where no C compiler is found at install time, the build of each fails
with a warning and rlstream runs their Python references instead
(pipeline/records/avro_binary.py and trajectory.find_violation), about three times slower
on records.
"""

from setuptools import Extension, setup

FLAGS = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

setup(
    ext_modules=[
        Extension(
            "pipeline.records._avro_native",
            ["pipeline/records/_avro_native.c"],
            extra_compile_args=FLAGS,
            optional=True,
        ),
        Extension(
            "pipeline.records._contract_native",
            ["pipeline/records/_contract_native.c"],
            extra_compile_args=FLAGS,
            optional=True,
        ),
    ]
)
