"""Starting, wiring and supervising the processes of a distributed run.

This is not communication: engine/comm holds the transport, the schemes and the syncer that
these processes use. Here: the job's configuration as one typed object (config), the host
table a launcher starts from (tables: a hosts file, -H, -n, --gpus), the launcher that starts and
supervises the local workers (launcher), the cluster managers' variables (managers: SLURM, MPI,
torchrun, a PyTorchJob) and rank 0's rendezvous where managed workers learn the table
(rendezvous), a worker process (worker), a parameter-server shard process (shard), the relay
of the children's error lines (relay), and elastic training (elastic/: a driver that forms
generations of workers that come and go, and the worker that trains in them).
"""
