"""``mpflow serve`` on a port another server holds stops at once with a hint (issue 38): which port, and how to
pick another — not uvicorn's bare ``[Errno 98] Address already in use``. A real process against a real socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.harness.server import free_port


def test_a_port_in_use_stops_serve_with_a_hint(tmp_path):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        env = {**os.environ, "MPFLOW_DATA_DIR": str(tmp_path / "data"), "MPFLOW_WORKERS": "1"}
        run = subprocess.run(
            [sys.executable, "-m", "mpflow", "serve", "--port", str(port)],
            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
        )  # fmt: skip
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert f"cannot listen on 127.0.0.1:{port}" in run.stderr and f"holds port {port}" in run.stderr
    assert f"--port {port + 1}" in run.stderr and f"MPFLOW_PORT={port + 1}" in run.stderr
    assert not (tmp_path / "data").exists()  # stopped before anything started (no embedded Redis)
