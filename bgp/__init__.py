"""agentd's BGP-4 speaker: sans-IO sessions and FSM, RIB, best path, route reflection.

Knows nothing of Linux, etcd or the agent.  ``Speaker`` is the sans-IO core,
``SpeakerService`` runs it on asyncio, ``MemoryNetwork`` wires speakers together
in memory for tests.  ``BfdSession`` (sans-IO) and ``BfdService`` (asyncio, RFC 5881)
watch neighbours with BFD.
"""

from .bestpath import Reason, rank, select
from .bfd import BfdSession, BfdSettings, BfdStateChanged
from .bfd_transport import BfdService
from .fsm import TRANSITIONS, Event, IllegalTransition, State, transition
from .negotiation import Negotiated
from .peer import Peer
from .rib import AdjRibIn, BestPathChange, Path, Rib, Source
from .session import Session
from .settings import ListenRange, LocalSettings, PeerSettings
from .speaker import Origination, Speaker
from .transport import SpeakerService
from .views import PeerView, RibPathView

__all__ = [
    "AdjRibIn",
    "BestPathChange",
    "BfdService",
    "BfdSession",
    "BfdSettings",
    "BfdStateChanged",
    "Event",
    "IllegalTransition",
    "ListenRange",
    "LocalSettings",
    "Negotiated",
    "Origination",
    "Path",
    "Peer",
    "PeerSettings",
    "PeerView",
    "Reason",
    "RibPathView",
    "Rib",
    "Session",
    "Source",
    "Speaker",
    "SpeakerService",
    "State",
    "TRANSITIONS",
    "rank",
    "select",
    "transition",
]
