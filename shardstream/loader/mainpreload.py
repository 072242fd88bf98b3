"""Imported by the forkserver's server only (``workers.context`` puts it on the preload list): the
main script, imported there once as ``__mp_main__``, so each worker the server forks has it
already instead of importing it (and every module it imports) again.

multiprocessing means to do this itself (``'__main__'`` is on the forkserver's default preload
list), but in Python 3.11 the server is never told the script's path (``ForkServer.ensure_running``
keeps the key ``main_path`` of ``spawn.get_preparation_data``, which names it
``init_main_from_path``), so every worker imported the script on its own: 62 ms per worker start
for ``benchmarks/bench_s3_latency.py``, on the first batch's path. The path (and the rank's
``sys.argv``, which the script sees while it is imported, as in a worker) comes in ``MAIN_ENV``,
set by ``workers.context`` only for a script whose loaders start inside its
``if __name__ == "__main__":`` block (an unguarded script would run its training here). A worker's
``spawn.prepare`` then finds ``__main__`` is that script and does not import it again.
"""

from __future__ import annotations

import json
import os
import sys

from shardstream.loader.workers import MAIN_ENV
from shardstream.private import import_main_inherited


def _import_main() -> None:
    given = os.environ.get(MAIN_ENV)
    if not given:
        return
    path, argv = json.loads(given)
    if getattr(sys.modules.get("__main__"), "__file__", None) == path:
        return  # multiprocessing did it (a Python whose forkserver passes the path)
    saved, sys.argv = sys.argv, list(argv)  # the rank's, as spawn.prepare gives a worker that imports it
    try:
        import_main_inherited(path)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - (SystemExit too: argparse) each worker imports the script itself then, as before
        pass
    finally:
        sys.argv = saved


_import_main()
