"""Print a free TCP port on 127.0.0.1 (for torchrun's rendezvous in `make demo`)."""

import socket

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    print(s.getsockname()[1])
