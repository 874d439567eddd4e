"""icefall's fbank of a waveform that arrives block by block, equal frame for frame to the fbank of the whole.

lhotse's ``Fbank`` (``snip_edges=False``, 25 ms windows every 10 ms) makes
``(num_samples + 80) // 160`` frames of a 16 kHz waveform; frame ``i`` is
computed from samples ``[160 i - 120, 160 i + 280)`` alone, the waveform
reflected at its two ends. So the frames of a block whose windows lie inside
the samples seen so far are final, and only the last 400 samples or so must
be kept for the next block: :class:`FbankStream` keeps the samples from one
frame before the next frame it owes, computes the block's frames with
lhotse's ``Fbank`` itself and drops the first (whose window it reflected)
and those that reach past the samples seen (until :meth:`FbankStream.finish`,
where the true end is reflected as for the whole waveform).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from icefall_lite.data.audio import SAMPLE_RATE
from icefall_lite.data.features import NUM_MEL_BINS, fbank_extractor

FRAME_SHIFT = 160  # samples, 10 ms at 16 kHz
FRAME_LENGTH = 400  # samples, 25 ms
# Samples before 160 i that frame i's window starts at: (400 - 160) // 2.
WINDOW_LEFT = (FRAME_LENGTH - FRAME_SHIFT) // 2


def num_fbank_frames(num_samples: int) -> int:
    """Frames lhotse's Fbank makes of ``num_samples`` 16 kHz samples (``snip_edges=False``)."""
    return (num_samples + FRAME_SHIFT // 2) // FRAME_SHIFT


class FbankStream:
    """Feed 16 kHz samples with :meth:`accept`, get the fbank frames that are final; :meth:`finish` gives the rest.

    The frames of all calls, concatenated, equal ``fbank_extractor().extract(whole_waveform, 16000)``.
    """

    def __init__(self) -> None:
        self.extractor = fbank_extractor()
        self.buffer = np.zeros(0, dtype=np.float32)  # samples from self.start on
        self.start = 0  # global index of buffer[0], a multiple of FRAME_SHIFT
        self.next_frame = 0  # global index of the next frame to return

    def _frames(self, final: bool) -> Tensor:
        """Frames ``next_frame ..`` computable now, (n, 80); drops the samples no later frame needs."""
        first = self.next_frame - self.start // FRAME_SHIFT  # 1, or 0 at the very start
        if final:
            end = num_fbank_frames(self.buffer.size)
        else:
            # segment frame j is final if its window ends inside the buffer: 160 j + 280 <= len
            end = (self.buffer.size - (FRAME_LENGTH - WINDOW_LEFT)) // FRAME_SHIFT + 1
        if end <= first or self.buffer.size <= WINDOW_LEFT:
            return torch.zeros(0, NUM_MEL_BINS)
        feats = torch.from_numpy(self.extractor.extract(self.buffer, SAMPLE_RATE))[first:end]
        self.next_frame += feats.size(0)
        # Keep from one frame before the next: that frame's window then starts inside the buffer.
        keep_from = (self.next_frame - 1) * FRAME_SHIFT - self.start
        if keep_from > 0:
            self.buffer = self.buffer[keep_from:]
            self.start += keep_from
        return feats

    def accept(self, samples: np.ndarray) -> Tensor:
        """Append 16 kHz samples (float32 (n,)); return the frames that are now final, (m, 80)."""
        self.buffer = np.concatenate([self.buffer, np.asarray(samples, dtype=np.float32)])
        return self._frames(final=False)

    def finish(self) -> Tensor:
        """The frames left at the end of the waveform, (m, 80)."""
        return self._frames(final=True)


__all__ = ["FRAME_SHIFT", "num_fbank_frames", "FbankStream"]
