"""`python3 <this folder>`: the containers' command (`python3 -m vllm_serve` works too).

Run as a folder, Python puts the folder itself first on sys.path; its parent goes there instead,
so the modules import as the package they are and none of them stands in for a top-level module.
The path is not resolved: in a Kubernetes ConfigMap volume every file is a symlink into a
timestamped folder inside the mount, and the package's parent is the mount's parent.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).absolute().parent.parent)

from vllm_serve.main import main

main(sys.argv[1:])
