"""The order a bench runs its peers in, repeat after repeat (bench train's runs, bench comm
--allreduce's calls): each repeat in an order of its own, so that what one peer leaves behind
(memory still being freed, threads winding down) slows each other peer alike."""
from __future__ import annotations


def order(peers: list[str], k: int) -> list[str]:
    """Repeat ``k``'s order: row ``k`` of a balanced Latin square (Williams'), in which each
    peer comes right after every other one once in ``len(peers)`` rows (twice in twice as
    many, for an odd count), so that no run keeps the same predecessor: a run right after a
    parameter server's or a Gloo one's starts slower, and in one fixed order auto followed
    hybrid's PS every time and trailed the row of the scheme it planned in every loopback
    table (docs/engines.md). A rotation would not do: it keeps the neighbours."""
    n = len(peers)
    if n == 0:
        return []
    row, low, high = [0], 1, n - 1
    for i in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        if i % 2:
            row.append(low)
            low += 1
        else:
            row.append(high)
            high -= 1
    row = [(x + k) % n for x in row]
    if n % 2 and (k // n) % 2:
        row.reverse()
    return [peers[x] for x in row]
