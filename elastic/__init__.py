"""elastic: the library behind the elastic training daemon.

The control plane (``elastic.store``, ``elastic.rendezvous``, ``elastic.errors``)
imports without torch; only the worker-side modules import it.
"""

__version__ = "0.1.0"
