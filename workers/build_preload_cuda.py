"""Imported, for its effect, by the fork server of a cuda builder's processes (workers.builder):
TVM imported as in workers.build_preload, then one small kernel built for cuda (`warm_build`), so
that every build process forked from that server starts past what a process's first cuda build
sets up once. Nothing else imports it.

Measured on a 2 x H100 host with 32 cores, 32 processes building a quick resnet-last-conv config
each at once, as a 2-GPU job's first batch does: the first build took 7.2 s (median; its compile
step 6.2 s) in processes forked from a server that had only imported TVM, and 0.9 s (max 2.5 s)
in processes forked from one that had built a cuda kernel; their second builds took 0.9-1.0 s
either way, and a server that had built an llvm kernel did not help (7.2 s). On 2 cores the
first build costs only ~0.3 s more than the next. The server's build takes ~1.4 s there, once per
builder process, while the slots start; the slots wait for it."""

import workers.build_preload  # noqa: F401  (TVM imported, as for every build process)
from workers.builder import warm_build
from workers.compiler import BuildResult

result: BuildResult | None = None  # the warm-up build's, inherited by every forked build process

# A failed build is its result's status. Anything raised here would stop the fork server (it
# skips only ImportError) and every slot with it; the slots start as without this warm-up instead.
try:
    result = warm_build("cuda")
except Exception:
    pass
