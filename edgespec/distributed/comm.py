"""The process group: MLX's ring backend for tensors, a TCP side channel for control and liveness.

Tensors (activations, partial sums) travel inside MLX graphs (`mx.distributed.send/recv/
all_sum`). Everything small and Python-side travels on a side channel: rank 0 opens a TCP
port, every follower connects to it (a star), and rank 0 sends each forward call's inputs
and the cache operations to mirror. The same sockets carry heartbeats both ways, so a rank
that dies (closed socket) or goes silent (no heartbeat for `timeout` seconds) ends the
whole group with one clear line instead of leaving the others blocked in a receive.

Frames: 4-byte big-endian length, then a JSON header; arrays named in the header's
"arrays" list follow as raw bytes. JSON rather than pickle: the port is reachable from the
network and a pickle would run code. Followers authenticate with a random token that rank
0 hands out over the already-connected ring.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import secrets
import socket
import struct
import sys
import threading
import time

import mlx.core as mx
import numpy as np

from edgespec.distributed.errors import EXIT_PEER_LOST, DistributedError

HEARTBEAT_S = 1.0
__all__ = ["EXIT_PEER_LOST", "DistributedError", "Group", "HEARTBEAT_S"]


def _default_timeout() -> float:
    raw = os.environ.get("EDGESPEC_DISTRIBUTED_TIMEOUT", "10")
    try:
        value = float(raw)
    except ValueError:
        raise DistributedError(f"EDGESPEC_DISTRIBUTED_TIMEOUT={raw!r}: use a number of seconds") from None
    if value <= 0:
        raise DistributedError(f"EDGESPEC_DISTRIBUTED_TIMEOUT={raw!r}: must be positive")
    return value


# --- frames ---------------------------------------------------------------------------

def encode_array(a) -> tuple[dict, bytes]:
    """An mx/np array as (descriptor, bytes). bfloat16 (no numpy type) travels as float32."""
    dtype = None
    if isinstance(a, mx.array):
        dtype = str(a.dtype).removeprefix("mlx.core.")
        if a.dtype == mx.bfloat16:
            a = a.astype(mx.float32)
        a = np.array(a)
    a = np.ascontiguousarray(a)
    return {"dtype": dtype or str(a.dtype), "np": str(a.dtype), "shape": list(a.shape)}, a.tobytes()


def decode_array(desc: dict, raw: bytes) -> mx.array:
    a = np.frombuffer(raw, dtype=np.dtype(desc["np"])).reshape(desc["shape"])
    out = mx.array(a)
    return out.astype(getattr(mx, desc["dtype"])) if desc["dtype"] != desc["np"] else out


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, lock: threading.Lock, header: dict, arrays: dict | None = None) -> None:
    blobs = []
    if arrays:
        header = dict(header, arrays=[])
        for name, a in arrays.items():
            desc, raw = encode_array(a)
            header["arrays"].append(dict(desc, name=name, nbytes=len(raw)))
            blobs.append(raw)
    head = json.dumps(header).encode()
    with lock:
        sock.sendall(struct.pack(">I", len(head)) + head + b"".join(blobs))


def recv_frame(sock: socket.socket) -> tuple[dict, dict]:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    header = json.loads(_recv_exact(sock, n))
    arrays = {}
    for desc in header.pop("arrays", []):
        arrays[desc["name"]] = decode_array(desc, _recv_exact(sock, desc["nbytes"]))
    return header, arrays


# --- the group ------------------------------------------------------------------------

def _ring_ips() -> list[str]:
    """The first IP of each rank from the ring hostfile mlx.launch writes ($MLX_HOSTFILE)."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        raise DistributedError("MLX_HOSTFILE is not set: start the ranks with mlx.launch or edgespec --distributed")
    with open(path) as f:
        hosts = json.load(f)
    return [h[0].rsplit(":", 1)[0] for h in hosts]


class Group:
    """This process's place in the group, plus the side channel (see the module docstring).

    `on_lost(message)` runs when a peer is lost; by default it prints the message and ends
    the process with EXIT_PEER_LOST (a rank blocked inside an MLX receive cannot be
    interrupted any other way).
    """

    def __init__(self, timeout: float | None = None, on_lost=None):
        if "MLX_RANK" not in os.environ:
            raise DistributedError("not started as a distributed rank (MLX_RANK unset): use mlx.launch or --distributed")
        try:
            self.mx_group = mx.distributed.init(backend="ring", strict=True)
        except RuntimeError as e:
            raise DistributedError(f"could not form the ring: {e}") from None
        self.rank = self.mx_group.rank()
        self.size = self.mx_group.size()
        self.timeout = timeout or _default_timeout()
        self.on_lost = on_lost or self._exit_lost
        self.closing = False
        self._socks: dict[int, socket.socket] = {}  # peer rank -> socket
        self._locks: dict[int, threading.Lock] = {}
        self._seen: dict[int, float] = {}
        self.commands: queue.Queue = queue.Queue()  # followers: frames from rank 0
        self._connect()
        for peer in self._socks:
            threading.Thread(target=self._reader, args=(peer,), daemon=True, name=f"edgespec-dist-read{peer}").start()
        threading.Thread(target=self._heartbeat, daemon=True, name="edgespec-dist-heartbeat").start()
        if self.rank == 0:
            atexit.register(self.close)  # the followers leave their loop when rank 0 ends

    # set-up: rank 0 listens on an ephemeral port of its ring IP and hands (port, token)
    # to the followers through one all_sum over the ring (followers contribute zeros).
    def _connect(self) -> None:
        ips = _ring_ips()
        token = secrets.token_bytes(16)
        listener = None
        info = np.zeros(17, dtype=np.int32)
        if self.rank == 0:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((ips[0], 0))
            listener.listen(self.size)
            info[0] = listener.getsockname()[1]
            info[1:] = np.frombuffer(token, dtype=np.uint8)
        info = np.array(mx.distributed.all_sum(mx.array(info), group=self.mx_group))
        port, token = int(info[0]), bytes(info[1:].astype(np.uint8))
        if self.rank == 0:
            listener.settimeout(max(self.timeout, 30.0))
            try:
                while len(self._socks) < self.size - 1:
                    conn, _ = listener.accept()
                    conn.settimeout(self.timeout)
                    hello = _recv_exact(conn, 20)
                    if hello[:16] != token:
                        conn.close()
                        continue
                    peer = struct.unpack(">I", hello[16:])[0]
                    self._add(peer, conn)
            except TimeoutError:
                raise DistributedError(f"only {len(self._socks) + 1} of {self.size} ranks connected to rank 0") from None
            finally:
                listener.close()
        else:
            conn = socket.create_connection((ips[0], port), timeout=max(self.timeout, 30.0))
            conn.settimeout(self.timeout)
            conn.sendall(token + struct.pack(">I", self.rank))
            self._add(0, conn)

    def _add(self, peer: int, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socks[peer] = conn
        self._locks[peer] = threading.Lock()
        self._seen[peer] = time.monotonic()

    # --- liveness ---
    def _reader(self, peer: int) -> None:
        sock = self._socks[peer]
        while True:
            try:
                header, arrays = recv_frame(sock)
            except (OSError, ConnectionError, ValueError) as e:
                if self.closing:
                    return
                why = "timed out (no heartbeat)" if isinstance(e, TimeoutError) else "closed its connection"
                self.lost(peer, why)
                return
            self._seen[peer] = time.monotonic()
            op = header.get("op")
            if op == "ping":
                continue
            if op == "stop" and self.rank != 0:
                self.closing = True
            if self.rank != 0:
                self.commands.put((header, arrays))
            if op == "stop":
                return

    def _heartbeat(self) -> None:
        while not self.closing:
            for peer in list(self._socks):
                try:
                    send_frame(self._socks[peer], self._locks[peer], {"op": "ping"})
                except OSError:
                    if not self.closing:
                        self.lost(peer, "closed its connection")
                    return
            time.sleep(HEARTBEAT_S)

    def lost(self, peer: int, why: str) -> None:
        if self.closing:
            return
        self.closing = True
        if peer < 0:
            text = f"edgespec distributed: rank {self.rank} {why}; ending the group"
        else:
            who = "rank 0 (the driver)" if peer == 0 else f"rank {peer}"
            text = f"edgespec distributed: rank {self.rank} lost {who}: it {why}; ending the group"
        self.on_lost(text)

    @staticmethod
    def _exit_lost(message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_LOST)

    # --- control messages (rank 0 -> followers) ---
    def broadcast(self, header: dict, arrays: dict | None = None) -> None:
        for peer in range(1, self.size):
            try:
                send_frame(self._socks[peer], self._locks[peer], header, arrays)
            except OSError:
                self.lost(peer, "closed its connection")
                raise DistributedError(f"rank {peer} is gone") from None

    def next_command(self) -> tuple[dict, dict]:
        return self.commands.get()

    def close(self) -> None:
        """Rank 0: tell the followers to exit; everyone: stop the heartbeat and close sockets."""
        if self.closing:
            return
        if self.rank == 0:
            try:
                self.broadcast({"op": "stop"})
            except DistributedError:
                pass
        self.closing = True
        for sock in self._socks.values():
            try:
                sock.close()
            except OSError:
                pass
