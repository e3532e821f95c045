"""The embedded services' ports (``local_broker.free_port``) lie below the kernel's ephemeral range,
so a broker restarted on its ports gets them back: an ephemeral port, free while its broker was
down, could be taken as the local port of any outgoing connection (the fault campaign's broker
restart failed with "Address already in use", seed 5105)."""

import socket

from offsetlake.embedded.local_broker import EPHEMERAL_RANGE, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_can_be_listened_on():
    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports), (low, ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[0]))
        sock.listen()
