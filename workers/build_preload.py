"""Imported, for its effect, by the build processes' fork server (workers.builder): TVM imported
there once, as a build process needs it (`_init_pool_process`), so that every build process forked
from that server starts with TVM loaded instead of importing it anew. Nothing else imports it."""

from workers.builder import _init_pool_process

_init_pool_process()
