"""A restore writes a rank's parameters before its optimizer shard: megatron-core's
distributed optimizer keeps fp32 main parameters as views of the rank's slice of its fp32
parameters, so a peer's parameters (older there under an overlapped all-gather) written last
would overwrite the shard's main parameters restored from the ring replica."""

from __future__ import annotations

import types

import torch

from deadpool_megatron.megatron.shard import RankState


def test_the_optimizer_shard_wins_over_a_peers_parameters_where_they_share_memory():
    model = torch.nn.Linear(4, 2, bias=False)
    flat = model.weight.detach().view(-1)
    main = flat[4:]  # this rank's slice, as a view (fp32 parameters, distributed optimizer)
    main.requires_grad_(True)
    adam = torch.optim.AdamW([main], lr=0.1)
    main.grad = torch.ones_like(main)
    adam.step()
    optimizer = types.SimpleNamespace(optimizer=adam)
    state = RankState([model], optimizer, scheduler=None)
    layout = state.layout
    buffer = torch.zeros(layout.total_nbytes, dtype=torch.uint8)
    for entry in layout.entries:  # the replica's main parameters 7, the peer's parameters 1
        value = 7.0 if entry.name.endswith(".param") else 1.0
        tensor = buffer[entry.offset : entry.offset + entry.nbytes].view(entry.dtype)
        tensor.fill_(value)
    state.write_from(buffer)
    assert model.weight.detach().view(-1)[:4].tolist() == [1.0] * 4  # the peer's, elsewhere
    assert main.detach().tolist() == [7.0] * 4  # the replica's, in this rank's slice
