"""``python -m maec_core.native [--force]``: build the compiled helpers (see the package
doc), unless the build of the current source is there already.

Exits 0 without a compiler, saying so: the helpers are optional, torch gives the same
results more slowly.
"""

from __future__ import annotations

import subprocess
import sys

from maec_core.native import build, library_path


def main() -> int:
    if library_path().is_file() and "--force" not in sys.argv[1:]:
        return 0
    try:
        path = build()
    except OSError as e:
        # No compiler, or a package folder this user cannot write to.
        print(f"maec_core.native: not built ({e}); row scores use torch "
              "(same results, slower)")
        return 0
    except subprocess.CalledProcessError as e:
        print(f"maec_core.native: the C compiler failed; row scores use torch "
              f"(same results, slower):\n{e.stderr}", file=sys.stderr)
        return 0
    print(f"maec_core.native: built {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
