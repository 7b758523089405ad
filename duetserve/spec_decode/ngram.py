"""N-gram (prompt lookup) proposer: drafts copied from the request's own tokens.

    tokens:  ... a b c X Y Z ... a b c          the last n tokens (the suffix, n from
                     ^^^^^^^^^^^^                prompt_lookup_max down to _min) occurred
                     drafts = X Y Z (up to k)    earlier: propose what followed them

The longest suffix that has an earlier occurrence wins; among occurrences the most recent
one (closest to the end) is used. The drafts' distribution q is one-hot (the verifier
accepts a draft x with probability p(x)). Pure: reads the token list, keeps no state.
"""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k drafts following the most recent earlier occurrence of the longest
        matching suffix of `token_ids`; [] when no suffix of min_n..max_n tokens recurs."""
        num = len(token_ids)
        if k <= 0 or num < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = tokens[-1]
        # candidate end positions e (exclusive) of an earlier occurrence: tokens[e-1] == last
        # and e < num (the suffix itself ends at num)
        ends = np.flatnonzero(tokens[:-1] == last) + 1
        if ends.size == 0:
            return []
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            suffix = tokens[num - n:]
            ok = ends[ends >= n]
            if ok.size == 0:
                continue
            # compare the n-gram ending at each candidate with the suffix, newest first
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [num-n, n]
            starts = ok - n
            match = np.all(windows[starts] == suffix, axis=1)
            hits = starts[match]
            if hits.size:
                start = int(hits[-1]) + n        # the most recent occurrence
                return token_ids[start:start + k]
        return []
