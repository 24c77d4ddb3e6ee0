/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The maps shared by podpath.c and the agent (agentd/dataplane/bpf/podpath.py mirrors them
 * and checks the sizes against the object file when it loads it).  Addresses in network
 * byte order, counters and flags in host order.
 */
#ifndef AGENTD_PODPATH_H
#define AGENTD_PODPATH_H

#include <linux/types.h>

#include "datapath.h" /* agentd_ttl_down */

/* pod_ips: hash, a local pod's IPv4 address -> the host side of its veth. */
struct pod_value {
	__u32 ifindex;
};

/* pod_stats: per-CPU array, indexed by what a program did with a pod's TCP packet. */
enum pod_verdict {
	POD_CARRIED = 0,         /* redirected: into the receiving pod, or out toward its node */
	POD_NO_CONNTRACK = 1,    /* no confirmed conntrack entry: the normal path */
	POD_NOT_ESTABLISHED = 2, /* the connection is not (or no longer) ESTABLISHED */
	POD_NAT = 3,             /* translated (a Service), or a helper reads it: the normal path */
	POD_NO_ROUTE = 4,        /* to another node, but no FIB answer with a resolved neighbour */
	POD_VERDICTS = 5,
};

struct pod_stats {
	__u64 packets; /* wire packets (a GSO super-packet counts its segments) */
	__u64 bytes;
};

/* pod_config: array of one, written by the agent. */
enum pod_config_flag {
	POD_CFG_ON = 1 << 0,    /* carry between pods of this node */
	POD_CFG_ROUTE = 1 << 1, /* carry between pods of this node and pods of other nodes too */
	POD_CFG_COUNT = 1 << 2, /* count what is carried per connection (flow records: podflows) */
	POD_CFG_RECORD = 1 << 3, /* record pods' IPv4 TCP connections (podconns, podrecs); needs POD_CFG_COUNT */
	POD_CFG_RECORD_REMOTE = 1 << 4, /* ... to other nodes' pods too: every packet from them passes agentd_pod_wire */
};

/* The packet mark bit a program sets on the SYN of a connection it records: the agent's table
 * ``ip agentd-flows`` masks conntrack's events for exactly those (nft ``ct event set 0x0`` on
 * the connection's first packet, before its entry is confirmed, when no NAT applies). */
#define POD_RECORD_MARK 0x00800000
/* ... and the conntrack mark bit that rule sets on the entry it masks: the answer's program
 * reads it (podconn_plain) to know that the connection's events are masked, i.e. that conntrack
 * did not hold it before the marked SYN. */
#define POD_RECORD_CTMARK 0x00800000

/* podflows: LRU hash, a connection the programs carried packets of -> how many, each way
 * (conntrack does not count what it does not see; the agent adds these to the connection's
 * end record).  The key is the connection's two ends in a fixed order, the lower (address,
 * port) first, so both directions and both programs find one entry; counts are indexed by
 * the end that sent them: [0] the lower end, [1] the other. */
struct podflow_key {
	__be32 addr[2];
	__be16 port[2];
};

struct podflow_value {
	__u64 packets[2]; /* one per packet as the stack sees it (a GSO super-packet is one), as conntrack counts */
	__u64 bytes[2];   /* IP lengths, as conntrack counts */
	__u64 first_tai;  /* CLOCK_TAI ns of the entry's first carried packet: which connection on the tuple
			   * the counts are of (the one conntrack held from its start to its stop then) */
};

/* podends: ring buffer of these.  A new connection on a tuple (its SYN or SYN-ACK passed a
 * program) moves the entry of the one before out of podflows, so the next connection's
 * counts are its own: the agent matches them to the old connection's end (by first_tai, which
 * falls between that connection's start and stop as conntrack stamps them). */
struct podflow_end {
	struct podflow_key key;
	__u32 pad;
	struct podflow_value value;
};

/* podconns: hash (preallocated; full: a new connection is not recorded here), an IPv4 TCP
 * connection between pods the programs record themselves
 * (POD_CFG_RECORD) -> what they saw of it: every packet of it that passed a program of this
 * node, carried or handed to the stack (the key and the sides as podflows'). */
enum podconn_state {
	PODCONN_SYN = 1,     /* its SYN passed, marked (conntrack tells nobody of a connection whose
			      * first packet it was); no answer yet */
	PODCONN_OPEN = 2,    /* answered (SYN-ACK): its start went to the agent */
	PODCONN_CLOSING = 3, /* both ends sent FIN: the packet that acknowledges the last of them
			      * unacknowledged ends it (enum podconn_fin) */
	PODCONN_RESET_LO = 4, /* the lower end sent RST: ended by the agent (podrsts) unless that end */
	PODCONN_RESET_HI = 5, /* ... sends again without RST (back to OPEN: its TCP ignored it) */
};

/* The layout of struct podconn_value and the meaning of its fields, enum podconn_state and
 * enum podconn_fin included: a change to any of them, the map's size the same or not, takes
 * a new number here (and in podpath.py), so that an upgraded agent replaces the pinned map
 * instead of reading an older agent's entries its own way (their connections end, GONE). */
#define PODCONN_LAYOUT 1

struct podconn_value {
	__u64 packets[2];
	__u64 bytes[2];
	__u64 first_tai; /* CLOCK_TAI ns of its SYN */
	__u64 last_tai;  /* of its last packet */
	__u32 state;     /* enum podconn_state */
	__u8 client;     /* the side that sent the SYN */
	__u8 fin_ack_hi[3]; /* with PODCONN_FIN_HI: the low 24 bits of the acknowledgement number
			     * that acknowledges the higher end's FIN (host order, low byte first) */
	__u32 fins;      /* enum podconn_fin (set with an atomic or: both ends' packets may pass
			  * programs on two CPUs at once) */
	union {
		__u32 client_seq; /* the SYN's sequence number (as on the wire): a SYN of the client
				   * with the same is that SYN sent again (its answer lost) -- until
				   * the lower end's FIN, after which no SYN of the connection's
				   * first, nor its answer, can come any more: */
		__u32 fin_ack_lo; /* with PODCONN_FIN_LO: the acknowledgement number (host order)
				   * that acknowledges the lower end's FIN */
	};
};

/* podconn_value.fins: a SYN past the answer, and the close, told from both ends' FINs and their acknowledgements (each
 * end's FIN's number kept in a field of its own: fin_ack_lo, and 24 bits of fin_ack_hi, enough
 * to tell an acknowledgement of the FIN from one of data up to 8 MB before it), so that the
 * end counts every packet of the close on each node, whatever order the node sees them in. */
enum podconn_fin {
	PODCONN_FIN_LO = 1,       /* the lower end sent FIN */
	PODCONN_FIN_HI = 2,       /* the higher end sent FIN */
	PODCONN_FIN_ACKED_LO = 4, /* the lower end's FIN acknowledged */
	PODCONN_FIN_ACKED_HI = 8, /* the higher end's FIN acknowledged */
	PODCONN_NEW_SYN_LO = 16,  /* past the answer, the lower end sent a SYN with another number than
				   * the connection's first, not yet answered: a new connection's on
				   * the tuple if a SYN-ACK answers it, a stray one if an ACK does */
	PODCONN_NEW_SYN_HI = 32,  /* ... the higher end did */
};

/* podrecs: ring buffer of these: a recorded connection's start and end (podlost: per-CPU
 * array of one __u64, the records the ring could not take). */
enum podconn_kind {
	PODREC_START = 1, /* answered: forwarded */
	PODREC_FIN = 2,   /* ended: both FINs and the last ACK */
	PODREC_RST = 3,   /* ended: reset */
	PODREC_REUSED = 4, /* ended: a new SYN took its tuple */
};

struct podconn_record {
	struct podflow_key key;
	__u32 kind; /* enum podconn_kind */
	struct podconn_value value;
};

/* podrsts: ring buffer of these, apart from podrecs (whose records an agent of any version
 * reads as starts and ends): a connection recorded here went to PODCONN_RESET_LO or _HI (a
 * RST passed), at ``tai`` (CLOCK_TAI ns).  Only a hint: the agent looks at the entry again
 * RESET_TIMEOUT later and ends it as its sweep would (recorder.py), so its end comes about
 * then, not at the next sweep; a hint lost (the ring full) leaves it to the sweep. */
struct podconn_hint {
	struct podflow_key key;
	__u32 pad;
	__u64 tai;
};

struct pod_config {
	__u32 flags;          /* enum pod_config_flag */
	__u32 established_ms; /* nf_conntrack_tcp_timeout_established, renewed on carried packets */
	__u32 liberal_before; /* not read by the programs: the agent's note of what
			       * nf_conntrack_tcp_be_liberal was before it set it (put back on leave) */
	__be32 cluster_net;   /* the cluster's pod network: only pods' traffic between nodes is carried */
	__be32 cluster_mask;
	__u32 wire_ifindex;   /* the underlay device agentd_pod_wire is on (read at a SYN to another node's pod) */
	__u32 conns_layout;   /* not read by the programs: the agent's note of PODCONN_LAYOUT, the
			       * layout the pinned podconns has (a pin of another is not adopted) */
};

/* IPv6 has maps of its own beside these (so that theirs keep their shapes, and an upgraded
 * agent adopts them with what they hold):
 * pod_ips6: hash, a local pod's IPv6 address -> struct pod_value;
 * pod_stats6: per-CPU array of struct pod_stats by enum pod_verdict, for IPv6 TCP;
 * pod_config6: array of one, the cluster's IPv6 pod network (the flags are pod_config's). */
struct pod6_key {
	__u8 addr[16];
};

struct pod_config6 {
	__u8 cluster_net[16];
	__u8 cluster_mask[16];
};

/* podflow6: podflows for IPv6 connections (a map of its own, so that IPv4's key and its
 * hashing stay 12 bytes; named agentd_podflow6, as the kernel keeps 15 characters of a
 * map's name).  The same order: the lower (address, port) first, addresses compared as the
 * 128-bit numbers they are; the same value. */
struct podflow6_key {
	__u8 addr[2][16];
	__be16 port[2];
};

/* podends carries these too, told apart from struct podflow_end by their size (80 octets,
 * podflow_end's 56): one ring for both families, read in one pass. */
struct podflow6_end {
	struct podflow6_key key;
	__u32 pad;
	struct podflow_value value;
};

#endif
