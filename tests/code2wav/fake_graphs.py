"""ShapeGraphs whose "capture" runs on CPU tensors, for the graph sets' bookkeeping tests.

CUDA graphs cannot run without a GPU, so a captured "graph" here recomputes its function into the
output memory fixed at capture on every replay, as a real replay overwrites its static outputs.
Buckets, padding, budgets and copy-out are the real class's code; only ``_graphable`` and
``_capture`` differ. The real capture path is exercised by the CUDA tests beside these.
"""

from minicpmo_rt.code2wav.hift_graph import ShapeGraphs


class FakeGraphs(ShapeGraphs):
    def _graphable(self, xs):
        return not self.off

    def _capture(self, xs, fn):
        static_in = [x.clone() for x in xs]
        out = fn(*static_in)

        class Replay:
            def replay(self):
                new = fn(*static_in)
                for o, n in zip(out, new) if isinstance(out, tuple) else ((out, new),):
                    o.copy_(n)

        return Replay(), static_in, out, []
