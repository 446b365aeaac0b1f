"""The link probe reads a shaped link at its rate, not at its burst's.

Two workers' endpoints in two network namespaces joined by a 1 Gbit/s link shaped with tbf,
whose bucket lets 500 KB through at veth's speed (engine/perf/netns.py): one 1 MB message
read it at 1.70-1.80 Gbit/s, which made auto price Poseidon's own schemes on a link 1.75x faster
than the engines' (whose probe streams 4 MB) and plan hd where MPI ran 1.3x faster. Needs root
and iproute2; skipped, saying so, without them.
"""
from __future__ import annotations

import os
import subprocess
import sys

from engine.comm.auth import KEY_ENV, key_hex, new_key
from engine.perf.netns import EmulatedCluster
from tests.test_comm_train import ROOT
from tests.test_perf_netns import needs_namespaces

pytestmark = needs_namespaces

RATE = 1e9

WORKER = """
import sys, time
from engine.comm.auth import job_key
from engine.comm.probe import probe_link
from engine.comm.syncer import open_worker
from engine.comm.transport import WORKER
from poseidon_cli.launch.hostfile import parse_hosts_text
rank = int(sys.argv[1])
ep = open_worker(rank, parse_hosts_text(sys.argv[2]), key=job_key(None), timeout=60,
                 shards=False, max_frame_bytes=2 << 20)
if rank == 0:
    link = probe_link(ep, (WORKER, 1))
    print(8 / link.beta_s_per_byte, flush=True)
else:
    time.sleep(120)  # its transport echoes the probe; the cluster kills it on the way out
"""


def test_a_token_bucket_link_reads_at_its_rate():
    env = {**os.environ, KEY_ENV: key_hex(new_key()), "PYTHONPATH": str(ROOT)}
    with EmulatedCluster(2, RATE) as c:
        hosts = "".join(f"{r} {c.addresses[r]} 29500\n" for r in range(2))
        c.run(1, [sys.executable, "-c", WORKER, "1", hosts], cwd=ROOT, env=env,
              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = c.run(0, [sys.executable, "-c", WORKER, "0", hosts], cwd=ROOT, env=env,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = probe.communicate(timeout=120)
        assert probe.returncode == 0, err[-2000:]
        bits_per_s = float(out.split()[-1])
    # the stream still meets each direction's 500 KB bucket at veth's speed: read here at
    # 1.17-1.20x the rate, against 1.70x for one 1 MB message; a busy machine only reads it
    # slower. The lower bound catches a unit error (8x)
    assert 0.2 * RATE <= bits_per_s <= 1.35 * RATE, bits_per_s
