"""Starting, wiring and supervising the processes of a distributed run.

This is not communication: engine/comm holds the transport, the schemes and the syncer that
these processes use. Here: the job's configuration as one typed object (config), the launcher
that starts and supervises the local workers (launcher), a worker process (worker), a
parameter-server shard process (shard), and the relay of the children's error lines (relay).
"""
