"""The C extensions of rlstream's record path (everything else is in pyproject.toml).

Both are optional: where no C compiler is found at install time, the build of each fails
with a warning and rlstream runs their Python references instead
(pipeline/records/avro_binary.py and trajectory.find_violation), about three times slower
on records. With RLSTREAM_NO_C_EXTENSIONS=1 nothing is compiled: a second editable
environment over a source tree whose extensions the first one built (infra/dev.sh's
verifiers environment, made while tests load them) uses those and never rewrites them.
"""

import os

from setuptools import Extension, setup

FLAGS = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

EXTENSIONS = [
    Extension(
        f"pipeline.records.{name}",
        [f"pipeline/records/{name}.c"],
        extra_compile_args=FLAGS,
        optional=True,
    )
    for name in ("_avro_native", "_contract_native")
]

setup(ext_modules=[] if os.environ.get("RLSTREAM_NO_C_EXTENSIONS") == "1" else EXTENSIONS)
