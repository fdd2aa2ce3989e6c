"""The chunk table and the token-major <-> chunk-major moves."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgdn.reference.layout import CHUNK, chunk_table, from_chunks, to_chunks


def test_dense_table():
    t = chunk_table(None, 2, 130)
    assert (t.N, t.NC, t.chunk_size) == (2, 6, CHUNK)
    assert t.chunk_batch.tolist() == [0, 0, 0, 1, 1, 1]
    assert t.chunk_seq.tolist() == [0, 0, 0, 1, 1, 1]
    assert t.chunk_start.tolist() == [0, 64, 128, 0, 64, 128]
    assert t.chunk_len.tolist() == [64, 64, 2, 64, 64, 2]
    assert t.seq_first_chunk.tolist() == [0, 3]
    assert t.seq_num_chunks.tolist() == [3, 3]


def test_varlen_table_with_empty_sequences():
    t = chunk_table(torch.tensor([0, 0, 64, 64, 200], dtype=torch.int32), 1, 250)
    assert (t.N, t.NC) == (4, 4)
    assert t.seq_num_chunks.tolist() == [0, 1, 0, 3]
    assert t.seq_first_chunk.tolist() == [0, 0, 1, 1]
    assert t.chunk_seq.tolist() == [1, 3, 3, 3]
    assert t.chunk_start.tolist() == [0, 64, 128, 192]
    assert t.chunk_len.tolist() == [64, 64, 64, 8]
    assert t.chunk_batch.tolist() == [0, 0, 0, 0]


def test_list_offsets_and_batch_check():
    assert chunk_table([0, 3, 70], 1, 80).chunk_len.tolist() == [3, 64, 3]
    with pytest.raises(ValueError, match="B == 1"):
        chunk_table([0, 3], 2, 80)


def test_round_trip_and_padding():
    cu = [0, 5, 5, 140]
    t = chunk_table(cu, 1, 220)
    x = torch.randn(1, 220, 3, 2)
    xc = to_chunks(x, t)
    assert xc.shape == (t.NC, CHUNK, 3, 2)
    assert (xc[0, 5:] == 0).all() and (xc[3, 7:] == 0).all()  # padding slots of partial chunks
    torch.testing.assert_close(xc[1, :10], x[0, 5:15])  # chunk 0 of sequence 2 starts at its first token
    back = from_chunks(xc, t)
    torch.testing.assert_close(back[:, :140], x[:, :140])
    assert (back[:, 140:] == 0).all()  # tokens after cu[-1] belong to no chunk


def test_to_chunks_rejects_wrong_shape():
    with pytest.raises(ValueError, match="chunk table"):
        to_chunks(torch.zeros(1, 10, 2), chunk_table(None, 1, 11))


def test_gradient_through_moves():
    t = chunk_table([0, 70, 90], 1, 100)
    x = torch.randn(1, 100, 2, requires_grad=True)
    from_chunks(to_chunks(x, t) * 3, t).sum().backward()
    assert (x.grad[:, :90] == 3).all() and (x.grad[:, 90:] == 0).all()


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 200), min_size=1, max_size=6),
    pad=st.integers(0, 100),
    chunk=st.sampled_from([16, 64]),
)
def test_table_invariants(lens, pad, chunk):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1] + pad
    t = chunk_table(cu, 1, T, chunk)
    assert int(t.chunk_len.sum()) == cu[-1]
    assert bool((t.chunk_len >= 1).all() and (t.chunk_len <= chunk).all())
    for n, length in enumerate(lens):
        first, count = int(t.seq_first_chunk[n]), int(t.seq_num_chunks[n])
        assert count == -(-length // chunk)
        for c in range(count):
            assert int(t.chunk_seq[first + c]) == n
            assert int(t.chunk_start[first + c]) == cu[n] + chunk * c
    # every token inside a sequence sits in exactly one slot; the moves are inverse on those tokens
    x = torch.arange(T, dtype=torch.float64).reshape(1, T, 1) + 1
    xc = to_chunks(x, t)
    assert sorted(xc[xc > 0].tolist()) == list(range(1, cu[-1] + 1))
    back = from_chunks(xc, t)
    assert torch.equal(back[0, : cu[-1]], x[0, : cu[-1]]) and bool((back[0, cu[-1] :] == 0).all())
