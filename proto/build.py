"""Regenerate the protobuf and gRPC modules next to their `.proto` files.

    python -m proto.build      (also `make proto`)

The generated modules are committed so that a fresh clone needs no code generator;
run this after changing a `.proto` file.  It rewrites the generated imports to be
package-relative (`from proto import x_pb2`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> int:
    import grpc_tools
    from grpc_tools import protoc  # only needed to regenerate

    include = Path(grpc_tools.__file__).parent / "_proto"
    for proto in sorted(HERE.glob("*.proto")):
        rc = protoc.main(["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={HERE}",
                          f"--grpc_python_out={HERE}", str(proto)])
        if rc != 0:
            print(f"protoc failed on {proto.name}", file=sys.stderr)
            return rc
    for gen in HERE.glob("*_pb2*.py"):
        text = gen.read_text()
        fixed = re.sub(r"^import (\w+_pb2) as", r"from proto import \1 as", text, flags=re.M)
        gen.write_text(fixed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
