"""TOP's learning (Lin et al., TOP, IEEE TPDS 2024, §V): the training, and only the training, of its two learned
pieces.

* :mod:`.gpg` — the GPG stage partitioner behind scheduler ``top-gpg`` (§V-C): training graphs, REINFORCE with a
  greedy-rollout baseline, the validation against IOS's DP that picks the weights kept, the weights file
  (``opweave train-gpg``);
* :mod:`.maddpg` — multi-agent DDPG (§V-B eqs. 3-4): centralized critics, replay, soft target updates;
* :mod:`.policy` — Alg. 1's offline phase behind serving policy ``top``: the reward, eq. (2), on Z-scored
  quantities, the training loop against the simulated engine, the held-out evaluation that picks the actors kept,
  the policy file (``opweave train-policy``).

What runs at inference stays with its user and never imports this package: the ``top-gpg`` network, its feature
encoding, greedy decoding and the loading of its weights in :mod:`opweave.schedulers.top_gpg` (a scheduler is a pure
function of graph and costs); the ``top`` policy, its actors and the loading of a policy file in
:mod:`opweave.serve.engine.top`. This package sits above ``serve`` (training drives the simulated engine) and below
``cli``.
"""
