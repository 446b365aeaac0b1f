"""Elastic training: workers that come and go while the job trains.

The driver (driver.py, in the launcher's process) forms generations of workers; each worker
(member.py) trains generation after generation, committing its state in memory at
boundaries (boundary.py) and asking the driver whether the membership changes there. The
control messages (protocol.py), where the workers are listed (sources.py), the commit and
order a generation starts from (membership.py), who may join and what the batch becomes
(policy.py), the log lines and counters (events.py), a worker's connection to the driver
(client.py) and the command's options (start.py) are modules of their own.
"""
