"""The packed row (``agents.training.packing``): each shared prefix once, positions at each token's depth."""

import torch

from agents.training.packing import new_tokens, pack_paths


def test_a_packed_row_holds_each_shared_prefix_once_with_positions_at_each_tokens_depth():
    paths = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8, 4, 3], [2, 6]]
    ids = torch.tensor([p + [0] * (6 - len(p)) for p in paths])
    mask = torch.tensor([[1] * len(p) + [0] * (6 - len(p)) for p in paths])
    packed = pack_paths(ids, mask)
    # path 1 shares [5, 6] with path 0; path 2 all of path 0; path 3 nothing.
    assert packed.ids.tolist() == [[5, 6, 7, 8, 9, 4, 3, 2, 6]]
    assert packed.positions.tolist() == [[0, 1, 2, 3, 2, 4, 5, 0, 1]]
    assert packed.where.tolist() == [[0, 1, 2, 3, 0, 0], [0, 1, 4, 0, 0, 0], [0, 1, 2, 3, 5, 6], [7, 8, 0, 0, 0, 0]]
    assert packed.previous.tolist() == [-1, 0, 1, 2, 1, 3, 5, -1, 7]
    assert (packed.starts, packed.lengths, packed.offsets) == ([0, 2, 4, 0], [4, 3, 6, 2], [0, 4, 5, 7])
    assert packed.tokens == 9 and int(mask.sum()) == 15
    assert new_tokens(ids, mask.sum(-1), 2, [0, 1]) == 2 and new_tokens(ids, mask.sum(-1), 3, [0]) == 2
    flat = pack_paths(ids, mask, share=False)
    assert flat.tokens == 15 and flat.positions.tolist()[0][:7] == [0, 1, 2, 3, 0, 1, 2]
