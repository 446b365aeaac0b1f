"""Each cluster manager's variables, as it sets them, and one clear line for a wrong one."""
from __future__ import annotations

import pytest

from poseidon_cli.launch.managers import (DEFAULT_MASTER_PORT, ManagerError, NodePlacement,
                                          Placement, derived_port, detect, expand_nodelist,
                                          place_run, tasks_per_node)
from tests.test_comm_train import poseidon


@pytest.mark.parametrize("text, names", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("gpu5", ["gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_nodelist_expands_as_scontrol_show_hostnames(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("text, needle", [
    ("node[01-03", "'[' without ']'"), ("node]1", "']' without '['"), ("n[[1]]", "nested"),
    ("n[3-1]", "runs backwards"), ("n[a-b]", "'a-b' is not a number"), ("a,,b", "an empty name"),
])
def test_a_bad_nodelist_is_named(text, needle):
    with pytest.raises(ManagerError) as e:
        expand_nodelist(text, "SLURM_STEP_NODELIST")
    assert str(e.value).startswith(f"SLURM_STEP_NODELIST={text!r}") and needle in str(e.value)


def test_tasks_per_node():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ManagerError, match=r"'2\(3\)' is not N or N\(xM\)"):
        tasks_per_node("2(3)")


def srun(rank: int, **extra: str) -> dict[str, str]:
    """What srun -N2 --ntasks-per-node=2 sets for task ``rank`` (block distribution)."""
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "4", "SLURM_LOCALID": str(rank % 2),
            "SLURM_NODEID": str(rank // 2), "SLURM_STEP_NODELIST": "node[01-02]",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0",
            **extra}


def test_each_manager_placement():
    assert detect({}) is None
    p = detect(srun(3), hostname="x")
    assert p == Placement("SLURM", 3, 4, 1, 2, "node02", ("node01", derived_port("4242.0")))
    assert 12000 <= p.master[1] < 20000 and p.master != detect(srun(3, SLURM_JOB_ID="4243")).master
    assert detect(srun(3, MASTER_ADDR="10.0.0.1", MASTER_PORT="6000")).master == ("10.0.0.1", 6000)

    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "OMPI_MCA_ess_base_jobid": "123"}
    assert detect(ompi, hostname="box") == Placement("Open MPI", 1, 4, 1, 4, "box",
                                                      ("127.0.0.1", derived_port("123")))
    # several machines: mpirun does not say where rank 0 is
    p = detect({**ompi, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, hostname="box")
    assert p.master is None and "mpirun -x MASTER_ADDR=" in p.no_master
    # mpirun inside a SLURM allocation: mpirun's rank, not the batch step's SLURM_PROCID
    assert detect({**srun(0), **ompi}, hostname="box").rank == 1

    pmi = {"PMI_RANK": "2", "PMI_SIZE": "4", "MASTER_ADDR": "n1", "MASTER_PORT": "7000"}
    assert detect(pmi, hostname="box") == Placement("MPICH / Intel MPI", 2, 4, None, None, "box",
                                                     ("n1", 7000))

    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "GROUP_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "29400"}
    assert detect(torchrun, hostname="box") == Placement("torchrun", 5, 8, 1, 4, "node 1",
                                                         ("n1", 29400))
    # torchrun's agent store holds MASTER_PORT: the rendezvous takes the next one
    assert detect({**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "True"}).master == ("n1", 29401)
    # a PyTorchJob pod without nprocPerNode: one worker per pod (RANK, WORLD_SIZE, MASTER_*)
    pod = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
           "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1", "PET_NNODES": "2"}
    assert detect({k: v for k, v in pod.items() if not k.startswith("PET_")}).rank == 1
    # with nprocPerNode: 4, RANK is the pod's index and WORLD_SIZE counts workers: a node
    node = {**pod, "WORLD_SIZE": "8", "PET_NPROC_PER_NODE": "4"}
    assert detect(node) == NodePlacement("PyTorchJob", 1, 2, 4, ("job-master-0", 23456))
    assert detect({**node, "PET_NPROC_PER_NODE": "auto"}).nproc is None
    assert detect({"RANK": "0", "WORLD_SIZE": "1"}).master is None  # a job of one needs none
    assert DEFAULT_MASTER_PORT == detect({**pmi, "MASTER_PORT": ""}).master[1]


@pytest.mark.parametrize("env, line", [
    (srun(4, SLURM_PROCID="4"), "SLURM_PROCID=4 is out of range: SLURM_NTASKS=4 (ranks 0..3)"),
    (srun(0, SLURM_NTASKS="four"), "SLURM_NTASKS='four' is not a number"),
    (srun(0, SLURM_NODEID="2"), "SLURM_NODEID=2 is out of range: SLURM_STEP_NODELIST names 2 nodes"),
    (srun(1, SLURM_LOCALID="2"), "SLURM_LOCALID=2 is out of range: SLURM_STEP_TASKS_PER_NODE "
                                 "runs 2 tasks on node node01"),
    (srun(0, SLURM_STEP_TASKS_PER_NODE="3,2"), "SLURM_STEP_TASKS_PER_NODE='3,2' does not fit"),
    ({"SLURM_PROCID": "0"}, "SLURM: SLURM_NTASKS is not set"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 must be at least 0"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "2"},
     "LOCAL_RANK=4 is out of range: LOCAL_WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "70000"},
     "MASTER_PORT=70000 is not a port"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, "OMPI_COMM_WORLD_LOCAL_SIZE=3 is more than"),
    ({"PET_NNODES": "1:3", "PET_NODE_RANK": "0", "MASTER_ADDR": "m"}, "an elastic range"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "2", "MASTER_ADDR": "m"},
     "PET_NODE_RANK=2 is out of range: PET_NNODES=2"),
])
def test_a_wrong_variable_is_named(env, line):
    with pytest.raises(ManagerError) as e:
        detect(env, hostname="box")
    assert line in str(e.value)


def test_a_wrong_variable_is_one_line_from_the_cli(tmp_path, monkeypatch):
    solver = tmp_path / "s.prototxt"
    solver.write_text('net: "n.prototxt"\n')
    for var, value in srun(4, SLURM_PROCID="4").items():
        monkeypatch.setenv(var, value)
    done = poseidon("train", "--solver", str(solver), timeout=30)
    assert done.returncode == 1
    assert done.stderr.strip() == ("poseidon: error: SLURM_PROCID=4 is out of range: "
                                   "SLURM_NTASKS=4 (ranks 0..3)")


def test_how_a_run_is_placed():
    pod = {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "auto",
           "MASTER_ADDR": "m", "MASTER_PORT": "23456"}
    assert place_run({}, None, None, None, None, None) == (None, None)  # one process, as Caffe
    assert place_run({}, None, None, None, None, (0, 1)) == (None, 2)  # --gpus alone: -n 2
    assert place_run(srun(1), None, None, None, None, None)[0].rank == 1
    assert place_run(srun(1), None, None, 3, None, None) == (None, 3)  # -n says where
    assert place_run(srun(1), "h.txt", None, None, None, None) == (None, None)  # the file says
    assert place_run(srun(0, SLURM_NTASKS="1", SLURM_STEP_TASKS_PER_NODE="1",
                          SLURM_STEP_NODELIST="a"), None, None, None, None, None) == (None, None)
    node, nproc = place_run(pod, None, None, None, None, (0, 1, 2, 3))
    assert isinstance(node, NodePlacement) and nproc == 4
    with pytest.raises(ManagerError, match="give -H, --hosts or -n, not two"):
        place_run({}, None, "a:2", 2, None, None)
    with pytest.raises(ManagerError, match=r"--gpus starts one worker per GPU \(2\): -n 3"):
        place_run({}, None, None, 3, None, (0, 1))
