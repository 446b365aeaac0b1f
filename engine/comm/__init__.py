"""The communicator: everything that talks (docs/DESIGN.md, "The communicator").

Bottom to top, each layer importing only those below it:

- the wire: ``auth`` (AES-GMAC per job), ``pieces`` (large messages in verified pieces),
  ``transport`` (one ZeroMQ socket per process, checked multipart messages, liveness),
  ``stages`` (timing them), ``handshake`` (what workers agree on before the first gradient);
- what moves: ``units`` (a layer's parameters as flat vectors), ``codecs`` (fp16, sparse),
  ``fusion`` (small layers together);
- the schemes, one module each behind ``schemes.base.Scheme``: PS (with ``shard`` and
  ``aggregate``, PHub's summing server), SFB, ring, halving-doubling, and shm inside a machine;
  ``levels`` and ``topology`` run a dense scheme in two levels;
- the costs and the plan: ``link`` (alpha + beta·bytes), ``probe`` (measuring them), ``cost``
  (what a layer costs by each scheme), ``planner`` (the cheapest scheme per layer, SACP),
  ``plan_file`` (a plan on disk, pinned on resume);
- ``syncer`` (wait-free backprop: a layer's gradients go out as backward makes them),
  ``stats`` (counters), ``bind`` (a Net's layers as the arrays to synchronise), ``hosts``
  (the host table).

Starting and supervising the processes is the launcher's (poseidon_cli/launch); the engine's
layers never import this package, and it imports no layer module.
"""
