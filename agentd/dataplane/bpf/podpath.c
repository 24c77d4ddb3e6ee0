// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The pod fast path: the packets of an already accepted TCP connection of a pod of this node
 * go straight to where the stack would send them -- past the bridge, the route-up of isolated
 * pods, the node's routing, conntrack and the policy chains.  Two tc ingress programs:
 *
 *   agentd_pod_fast  on the host side of each local pod's veth.  To another pod of this node:
 *                    into that pod (bpf_redirect_peer).  To a pod of another node (the
 *                    cluster's pod network, POD_CFG_ROUTE): routed as the stack would route
 *                    it (bpf_fib_lookup: the next hop's MAC, TTL - 1) and sent out of the
 *                    device the route names.
 *   agentd_pod_wire  on the underlay device: from a pod of another node to a pod of this node,
 *                    TTL - 1 and into that pod (bpf_redirect_peer).  After the data path's
 *                    program there, it sees the packets that program decapsulated as well
 *                    while netfilter must see pods' packets (datapath.c deliver_gated).  A
 *                    source that is a pod of this node is left to the stack (forged: its
 *                    reverse-path filtering judges it).
 *
 * With POD_CFG_COUNT (flow records on) they count what they carry, per connection
 * (agentd_podflows for IPv4, agentd_podflow6 for IPv6): conntrack does not see it, and a
 * connection's end record adds it.
 *
 * Both carry IPv4 and IPv6 alike, each family with its own maps (pods, counters, cluster
 * network); for IPv6 the hop limit is decremented (no header checksum to mend) and the FIB
 * is asked with AF_INET6.
 * What decides is the kernel's own connection tracking, looked up with the bpf_skb_ct_lookup
 * kfunc: a packet is carried only when
 *   - it is TCP without SYN, FIN or RST (those go the normal way, so conntrack sees every
 *     state change of the connection): IPv4 not a fragment and without options, IPv6 with TCP
 *     as its first next header (no extension header: a fragment header among them), in a
 *     frame without an 802.1Q tag;
 *   - from a pod's veth, its source address is that pod's (the anti-spoofing check of the
 *     normal path); between nodes both ends are in the cluster's pod network;
 *   - conntrack has a confirmed entry for it -- confirmed means the normal path, policy
 *     included, accepted the connection's first packet -- in TCP state ESTABLISHED, with no
 *     NAT on it (a Service's translated flow stays on the normal path, which translates) and
 *     no conntrack helper (nft ct helper set: the helper must read every packet's payload).
 * Anything else is left to the stack (TC_ACT_UNSPEC).  The entry's timeout is renewed as
 * conntrack would renew it, so a busy carried connection does not expire.
 *
 * Conntrack does not see the carried packets, so its TCP window for the connection falls
 * behind; the agent sets nf_conntrack_tcp_be_liberal in the namespace where the fast path is
 * on, so that the connection's FIN and RST (normal path) are not judged out of window.
 *
 * nf_conn's fields are read through CO-RE relocations (the struct below names only what is
 * read; libbpf finds the kernel's offsets by name in the kernel's BTF, nf_conntrack's module
 * BTF where conntrack is a module), and libbpf resolves the kfuncs the same way.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/stddef.h>
#include <linux/tcp.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "podpath.h"

#define PASS TC_ACT_UNSPEC
#define IP_MF_OFFSET 0x3fff
#define CURRENT_NETNS -1
#define TCP_CONNTRACK_ESTABLISHED 3 /* enum tcp_conntrack */
#define IPS_EXPECTED (1UL << 0)
#define IPS_SRC_NAT (1UL << 4)
#define IPS_DST_NAT (1UL << 5)
#define IPS_HELPER (1UL << 13) /* a conntrack helper assigned by the ruleset (nft ct helper set) */
#define AF_INET_ 2
#define AF_INET6_ 10
#define IPV6_FLOWINFO_MASK 0x0fffffff /* traffic class and flow label */

struct ip_ct_tcp {
	__u8 state;
} __attribute__((preserve_access_index));

union nf_conntrack_proto {
	struct ip_ct_tcp tcp;
} __attribute__((preserve_access_index));

struct nf_conn {
	unsigned long status;
	__u32 mark;
	union nf_conntrack_proto proto;
} __attribute__((preserve_access_index));

/* struct bpf_ct_opts as of Linux 6.0 (NF_BPF_CT_OPTS_SZ, 12 bytes); later kernels take this
 * size too. */
struct ct_opts {
	__s32 netns_id;
	__s32 error;
	__u8 l4proto;
	__u8 dir;
	__u8 reserved[2];
};

extern struct nf_conn *bpf_skb_ct_lookup(struct __sk_buff *skb, struct bpf_sock_tuple *tuple, __u32 tuple_size,
					 struct ct_opts *opts, __u32 opts_size) __ksym;
extern void bpf_ct_release(struct nf_conn *ct) __ksym;
extern int bpf_ct_change_timeout(struct nf_conn *ct, __u32 timeout_ms) __ksym;

/* BTF-defined maps, pinned by name next to the data path's (see podpath.py). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __be32);
	__type(value, struct pod_value);
	__uint(max_entries, 4096);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_podips SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct pod_stats);
	__uint(max_entries, POD_VERDICTS);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_podstat SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct pod_config);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_podcfg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct pod6_key);
	__type(value, struct pod_value);
	__uint(max_entries, 4096);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_podips6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct pod_stats);
	__uint(max_entries, POD_VERDICTS);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_podstat6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct pod_config6);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_podcfg6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct podflow_key);
	__type(value, struct podflow_value);
	__uint(max_entries, 65536);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_podflows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct podflow6_key);
	__type(value, struct podflow_value);
	__uint(max_entries, 65536);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_podflow6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_podends SEC(".maps");

/* A preallocated hash, not an LRU one: an LRU map's insert and delete take its shared lists'
 * locks and touch a cold element each time, which cost the client's core of a short
 * connection more than all the rest of what the programs do for it.  Entries go explicitly
 * (at the end, and by the agent's sweep); when the map is full, a new connection is simply not
 * recorded here (not marked: conntrack's events tell of it). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct podflow_key);
	__type(value, struct podconn_value);
	__uint(max_entries, 65536);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_podconns SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1024 * 1024);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_podrecs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_podlost SEC(".maps");

/* Written only when a recorded connection goes to a RESET state (podpath.h: struct
 * podconn_hint); named agentd_podrsts, as the kernel keeps 15 characters of a map's name. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 * 1024);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_podrsts SEC(".maps");

/* kfuncs are for GPL-compatible programs: dual-licensed as datapath.c is. */
char _license[] SEC("license") = "Dual BSD/GPL";

static __always_inline int count_in(void *stats, __u32 verdict, struct __sk_buff *skb, int action)
{
	struct pod_stats *s = bpf_map_lookup_elem(stats, &verdict);

	if (s) {
		s->packets += skb->gso_segs > 1 ? skb->gso_segs : 1;
		s->bytes += skb->len;
	}
	return action;
}

#define count(verdict, skb, action) count_in(&agentd_podstat, verdict, skb, action)
#define count6(verdict, skb, action) count_in(&agentd_podstat6, verdict, skb, action)

/* ------------------------------------------------------------ per-connection counts (podflows) */

/* The podflows key of a packet's connection, and which end sent it (0: the lower). */
static __always_inline __u32 podflow_key(struct iphdr *ip, struct tcphdr *tcp, struct podflow_key *key)
{
	__u32 s = bpf_ntohl(ip->saddr), d = bpf_ntohl(ip->daddr);
	__u16 sp = bpf_ntohs(tcp->source), dp = bpf_ntohs(tcp->dest);

	if (s > d || (s == d && sp > dp)) {
		key->addr[0] = ip->daddr;
		key->addr[1] = ip->saddr;
		key->port[0] = tcp->dest;
		key->port[1] = tcp->source;
		return 1;
	}
	key->addr[0] = ip->saddr;
	key->addr[1] = ip->daddr;
	key->port[0] = tcp->source;
	key->port[1] = tcp->dest;
	return 0;
}

/* Count a carried packet of ``len`` IP bytes sent by end ``side`` of connection ``key`` in
 * ``flows`` (agentd_podflows or agentd_podflow6, a constant once inlined). */
static __always_inline void podflow_count_in(void *flows, void *key, __u32 side, __u64 len)
{
	struct podflow_value *v, fresh = {};

	v = bpf_map_lookup_elem(flows, key);
	if (!v) {
		fresh.first_tai = bpf_ktime_get_tai_ns();
		if (side) {
			fresh.packets[1] = 1;
			fresh.bytes[1] = len;
		} else {
			fresh.packets[0] = 1;
			fresh.bytes[0] = len;
		}
		if (!bpf_map_update_elem(flows, key, &fresh, BPF_NOEXIST))
			return;
		v = bpf_map_lookup_elem(flows, key); /* another CPU made it first */
		if (!v)
			return;
	}
	if (side) {
		__sync_fetch_and_add(&v->packets[1], 1);
		__sync_fetch_and_add(&v->bytes[1], len);
	} else {
		__sync_fetch_and_add(&v->packets[0], 1);
		__sync_fetch_and_add(&v->bytes[0], len);
	}
}

#define podflow_count(key, side, len) podflow_count_in(&agentd_podflows, key, side, len)
#define podflow6_count(key, side, len) podflow_count_in(&agentd_podflow6, key, side, len)

/* A SYN (or SYN-ACK) of a pod's starts a connection: what podflows holds for its tuple was an
 * earlier connection's, which goes to the agent through the ring. */
static __always_inline void podflow_restart(struct iphdr *ip, struct tcphdr *tcp)
{
	struct podflow_end end = {};
	struct podflow_value *v;

	podflow_key(ip, tcp, &end.key);
	v = bpf_map_lookup_elem(&agentd_podflows, &end.key);
	if (!v)
		return;
	end.value = *v;
	bpf_map_delete_elem(&agentd_podflows, &end.key);
	bpf_ringbuf_output(&agentd_podends, &end, sizeof(end), BPF_RB_NO_WAKEUP);
}

/* The IPv4 packet's length as conntrack counts it: the IP header's.  A short frame from a wire
 * comes padded, trimmed only after tc; 0 (BIG TCP) or more than the frame: the frame's. */
static __always_inline __u64 ip_bytes(struct __sk_buff *skb, struct iphdr *ip)
{
	__u64 len = skb->len - ETH_HLEN;
	__u32 ip_len = bpf_ntohs(ip->tot_len);

	return ip_len && ip_len < len ? ip_len : len;
}

/* ------------------------------------------------------------ connections recorded here (podconns) */

/* A record the ring could not take (full: the agent is behind or gone). */
static __always_inline void podconn_lost(void)
{
	__u32 zero = 0;
	__u64 *lost = bpf_map_lookup_elem(&agentd_podlost, &zero);

	if (lost)
		*lost += 1;
}

/* A record of ``key``'s connection, written in place in the ring: reserved and filled from the
 * entry, for the caller to submit (no copy on the stack).  NULL if the ring is full. */
static __always_inline struct podconn_record *podconn_record_of(struct podflow_key *key, struct podconn_value *v,
								 __u32 kind)
{
	struct podconn_record *rec = bpf_ringbuf_reserve(&agentd_podrecs, sizeof(*rec), 0);

	if (rec) {
		rec->key = *key;
		rec->kind = kind;
		rec->value = *v;
	}
	return rec;
}

/* No wake-up: the agent reads the ring on a timer, never waits on it. */
static __always_inline void podconn_emit(struct podflow_key *key, struct podconn_value *v, __u32 kind)
{
	struct podconn_record *rec = podconn_record_of(key, v, kind);

	if (rec)
		bpf_ringbuf_submit(rec, BPF_RB_NO_WAKEUP);
	else
		podconn_lost();
}

/* ``key``'s entry went to a RESET state: the agent ends it RESET_TIMEOUT after its last packet
 * unless that end sends again without RST (podpath.h: struct podconn_hint).  Only RSTs pay for
 * it; a hint the ring cannot take leaves the end to the agent's sweep (a few seconds later). */
static __always_inline void podconn_reset(struct podflow_key *key, struct podconn_value *v, __u32 side, __u64 now)
{
	__u32 reset = side ? PODCONN_RESET_HI : PODCONN_RESET_LO;
	struct podconn_hint hint = {};

	if (v->state == reset)
		return; /* a RST sent again: the hint before it stands (the agent looks at the last packet's time) */
	v->state = reset;
	hint.key = *key;
	hint.tai = now;
	bpf_ringbuf_output(&agentd_podrsts, &hint, sizeof(hint), BPF_RB_NO_WAKEUP);
}

/* The end of ``key``'s connection: its entry out of podconns, and its record -- only if this
 * program's delete took the entry out.  The value is copied before the delete; a party that
 * finds it gone (another CPU ended the same connection at the same time, as both ends' last
 * packets of a close between local pods may, or the agent's sweep took the entry between this
 * program's look-up and its delete) writes nothing: whoever took the entry out ends it, once
 * (the sweep records only what its take removed, and puts back an entry that changed under it:
 * that one is ended by a later sweep, never again by this program). */
static __always_inline void podconn_end(struct podflow_key *key, struct podconn_value *v, __u32 kind)
{
	struct podconn_record *rec = podconn_record_of(key, v, kind);

	if (bpf_map_delete_elem(&agentd_podconns, key)) { /* not this program's to end */
		if (rec)
			bpf_ringbuf_discard(rec, BPF_RB_NO_WAKEUP);
	} else if (rec) {
		bpf_ringbuf_submit(rec, BPF_RB_NO_WAKEUP);
	} else {
		podconn_lost();
	}
}

static __always_inline void podconn_count(struct podconn_value *v, __u32 side, __u64 len, __u64 now)
{
	if (side) {
		__sync_fetch_and_add(&v->packets[1], 1);
		__sync_fetch_and_add(&v->bytes[1], len);
	} else {
		__sync_fetch_and_add(&v->packets[0], 1);
		__sync_fetch_and_add(&v->bytes[0], len);
	}
	v->last_tai = now;
}

/* Whether conntrack holds the connection of ``tuple`` confirmed, untranslated and with its
 * events masked by the agent's table: its first packet passed every hook of this node, policy
 * included, was marked by a program (a SYN of a connection recorded here) and was the
 * connection's first (the table masks only a new entry's events, and marks the entry
 * POD_RECORD_CTMARK as it does; a translated connection's it leaves alone).  A connection
 * conntrack held before a program first marked its SYN -- a SYN sent again whose first was not
 * recorded (the map full, the sender not yet a pod the programs knew, recording not yet on) --
 * has its events unmasked and its entry unmarked: it stays conntrack's.  So does an expected
 * connection (a conntrack helper's: its first packet is related, not new, so the table never
 * masked it, though conntrack copies the master's mark into it), and every connection on a
 * kernel without conntrack marks (CONFIG_NF_CONNTRACK_MARK: no nf_conn.mark, and no table). */
static __always_inline int podconn_plain(struct __sk_buff *skb, struct bpf_sock_tuple *tuple)
{
	struct ct_opts opts = {.netns_id = CURRENT_NETNS, .l4proto = IPPROTO_TCP};
	unsigned long status;
	struct nf_conn *ct;
	__u32 mark = 0;

	ct = bpf_skb_ct_lookup(skb, tuple, sizeof(tuple->ipv4), &opts, sizeof(opts));
	if (!ct)
		return 0;
	status = ct->status;
	if (bpf_core_field_exists(ct->mark))
		mark = ct->mark;
	bpf_ct_release(ct);
	return !(status & (IPS_SRC_NAT | IPS_DST_NAT | IPS_EXPECTED)) && (mark & POD_RECORD_CTMARK);
}

/* The IPv4 TCP packet's tuple, as conntrack's look-up takes it. */
static __always_inline void ct_tuple(struct bpf_sock_tuple *tuple, struct iphdr *ip, struct tcphdr *tcp)
{
	tuple->ipv4.saddr = ip->saddr;
	tuple->ipv4.daddr = ip->daddr;
	tuple->ipv4.sport = tcp->source;
	tuple->ipv4.dport = tcp->dest;
}

/* The FIB lookup's question for an IPv4 TCP packet, as the stack would route it. */
static __always_inline void fib_of(struct bpf_fib_lookup *fib, struct __sk_buff *skb, struct iphdr *ip,
				   struct tcphdr *tcp)
{
	fib->family = AF_INET_;
	fib->tos = ip->tos;
	fib->l4_protocol = IPPROTO_TCP;
	fib->sport = tcp->source;
	fib->dport = tcp->dest;
	fib->ipv4_src = ip->saddr;
	fib->ipv4_dst = ip->daddr;
	fib->ifindex = skb->ingress_ifindex;
}

/* Whether a pod's SYN to an address of the cluster's pod network that is not a pod of this
 * node leaves by the underlay device (``wire``), whose program sees the answer: with host-gw
 * another node's pod does; an address of this node's own pod subnet (the bridge's, a pod whose
 * veth has no program) does not, nor one behind a tunnel device.  Asked at the SYN only. */
static __always_inline int podconn_wired(struct __sk_buff *skb, struct iphdr *ip, struct tcphdr *tcp, __u32 wire)
{
	struct bpf_fib_lookup fib = {};
	long ret;

	if (!wire)
		return 0;
	fib_of(&fib, skb, ip, tcp);
	ret = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	/* No neighbour yet (the SYN resolves it): the device is known all the same. */
	return (ret == BPF_FIB_LKUP_RET_SUCCESS || ret == BPF_FIB_LKUP_RET_NO_NEIGH) && fib.ifindex == wire;
}

/* Whether ``ack_seq`` acknowledges the FIN of end ``side`` (its number kept when it passed:
 * podconn_closing): all 32 bits for the lower end's, the low 24 for the higher end's. */
static __always_inline int podconn_fin_acked(struct podconn_value *v, __u32 side, __u32 ack_seq)
{
	__u32 hi = v->fin_ack_hi[0] | (__u32)v->fin_ack_hi[1] << 8 | (__u32)v->fin_ack_hi[2] << 16;

	if (side)
		return ((ack_seq - hi) & 0xFFFFFF) < 0x800000;
	return (__s32)(ack_seq - v->fin_ack_lo) >= 0;
}

/* A packet of ``key``'s connection from end ``side`` while a FIN has been seen, or carrying
 * one (``fin_end``: the acknowledgement number that would acknowledge it): the FIN's number
 * kept in that end's own field, and the other end's FIN acknowledged if this packet does
 * (podpath.h: enum podconn_fin); with both ends' FINs, CLOSING; with both acknowledged, the
 * end -- at that packet, so that the end counts the last ACK however the FINs met (one after
 * the other, or crossed on the way: then each node sees them in another order, and ending at
 * the first packet without FIN after both left one ACK out, a different one on each node).
 * A last ACK lost leaves the end to the agent's sweep (CLOSING_TIMEOUT), as before. */
static __always_inline void podconn_closing(struct podflow_key *key, struct podconn_value *v, __u32 side, int fin,
					    int ack, __u32 ack_seq, __u32 fin_end)
{
	__u32 mine = side ? PODCONN_FIN_HI : PODCONN_FIN_LO, theirs = side ? PODCONN_FIN_LO : PODCONN_FIN_HI;
	__u32 acked_theirs = side ? PODCONN_FIN_ACKED_LO : PODCONN_FIN_ACKED_HI;
	__u32 all = PODCONN_FIN_LO | PODCONN_FIN_HI | PODCONN_FIN_ACKED_LO | PODCONN_FIN_ACKED_HI;
	__u32 f = v->fins;

	if (ack && (f & theirs) && !(f & acked_theirs) && podconn_fin_acked(v, !side, ack_seq))
		f = __sync_fetch_and_or(&v->fins, acked_theirs) | acked_theirs;
	if (fin && !(f & mine)) { /* this end's FIN (sent again, it has the same number) */
		if (side) {
			v->fin_ack_hi[0] = fin_end;
			v->fin_ack_hi[1] = fin_end >> 8;
			v->fin_ack_hi[2] = fin_end >> 16;
		} else {
			v->fin_ack_lo = fin_end;
		}
		f = __sync_fetch_and_or(&v->fins, mine) | mine; /* after the number: read once the bit is */
	}
	if ((f & all) == all)
		podconn_end(key, v, PODREC_FIN);
	else if ((f & (PODCONN_FIN_LO | PODCONN_FIN_HI)) == (PODCONN_FIN_LO | PODCONN_FIN_HI) && v->state == PODCONN_OPEN)
		v->state = PODCONN_CLOSING; /* not over a RESET state: the agent ends that one as reset */
}

#define PODCONN_START 1        /* a SYN may open a record here: to a pod of this node, or on the wire */
#define PODCONN_START_WIRED 2  /* ... if it leaves by the underlay device (podconn_wired) */

/* Whether a pod's SYN may start a record and be marked here (POD_RECORD_MARK: its conntrack
 * entry, if it makes one, masked and marked; the no-route rule not asked): where its answer
 * passes a program of this node -- to a pod of this node, or out of the underlay device
 * (``may_start``: podconn_see). */
static __always_inline int podconn_may_mark(struct __sk_buff *skb, struct iphdr *ip, struct tcphdr *tcp,
					    int may_start, struct pod_config *cfg)
{
	return may_start == PODCONN_START ||
	       (may_start == PODCONN_START_WIRED && podconn_wired(skb, ip, tcp, cfg->wire_ifindex));
}

/* Whether a SYN-ACK from end ``side`` of a connection past its answer is that answer sent
 * again (the server's TCP answering the client's first SYN once more): it acknowledges that
 * SYN (client_seq, until the lower end's FIN takes the field: no first answer comes after a FIN). */
static __always_inline int podconn_answered_again(struct podconn_value *v, __u32 side, __u32 ack_seq)
{
	return side != v->client && ack_seq - 1 == bpf_ntohl(v->client_seq) && !(v->fins & PODCONN_FIN_LO);
}

/* A SYN-ACK (or a RST: ``rst``, the new connection refused) from end ``side`` of a
 * connection past its answer that answers the other end's SYN with a new number
 * (PODCONN_NEW_SYN_*: a new connection's on the tuple; podconn_see counted it in this one).
 * This one ends (REUSED, or RST if it was reset; at its last
 * packet: that SYN).  If conntrack holds the new one in an entry masked and marked
 * (podconn_plain) -- the same entry, if it ignored the SYN on a connection it held open and
 * took the new one up at this answer; or a new one it made of the SYN (the old one closed),
 * masked as a first SYN's is, the SYN marked where a first would be --, nothing else tells of
 * it: it is recorded here from this answer on (its start's time this answer's; a refused one
 * ends at once, reset).  Else (a new entry unmasked) it is conntrack's.  Returns whether the
 * packet is recorded here. */
static __always_inline int podconn_reopen(struct __sk_buff *skb, struct iphdr *ip, struct tcphdr *tcp,
					  struct podflow_key *key, struct podconn_value *v, __u32 side, __u64 len,
					  __u64 now, __u32 ack_seq, int rst, struct bpf_sock_tuple *tuple,
					  struct podconn_value *fresh)
{
	ct_tuple(tuple, ip, tcp);
	podconn_end(key, v, v->state == PODCONN_RESET_LO || v->state == PODCONN_RESET_HI ? PODREC_RST : PODREC_REUSED);
	if (!podconn_plain(skb, tuple))
		return 0;
	fresh->state = PODCONN_OPEN;
	fresh->client = !side;
	fresh->client_seq = bpf_htonl(ack_seq - 1);
	fresh->first_tai = now;
	fresh->last_tai = now;
	if (side) {
		fresh->packets[1] = 1;
		fresh->bytes[1] = len;
	} else {
		fresh->packets[0] = 1;
		fresh->bytes[0] = len;
	}
	if (bpf_map_update_elem(&agentd_podconns, key, fresh, BPF_NOEXIST)) {
		podconn_lost(); /* the map full (or another CPU's entry there first): recorded by nobody */
		return 0;
	}
	podconn_emit(key, fresh, PODREC_START);
	if (rst)
		podconn_end(key, fresh, PODREC_RST); /* refused: its start and its end */
	return 1;
}

/* An IPv4 TCP packet of a pod's connection that passes a program while the programs record
 * connections (POD_CFG_RECORD).  ``may_start``: whether a SYN may open a record here (the
 * answer will pass a program of this node): 0, PODCONN_START or PODCONN_START_WIRED.  Returns
 * 1 if the connection is recorded here (the packet is counted in podconns, not podflows), else
 * 0 (conntrack's events tell of it).
 *
 * SYN: a new entry (PODCONN_SYN), the packet marked (POD_RECORD_MARK: the agent's nft table
 * masks conntrack's events of the connection if the SYN is its first packet, and marks its
 * entry).  The answer -- SYN-ACK or RST from the other end -- while conntrack holds the entry
 * confirmed (its SYN passed policy), untranslated and marked (podconn_plain): the start goes to
 * the agent (podrecs); else the entry goes and the connection is conntrack's.  RST past the answer: the end, made by the agent RESET_TIMEOUT (2 s) after
 * the last packet (told by a hint, podconn_reset; else by its sweep) unless the end that sent it
 * sends again without RST (below).  FIN from both ends, then the packet that acknowledges
 * the last of them (podconn_closing): the end.  A SYN with a new number past the answer is
 * counted, and its answer tells what it was: a SYN-ACK ends the connection before it
 * (podconn_reopen), an ACK shows a stray one of this connection, which goes on.  The SYN sent
 * again (from the client, with the sequence number of its first, until a FIN) is counted, and
 * marked where a first SYN would be (podconn_may_mark).  What never ends so
 * (idle, a pod gone) the agent's sweep ends when conntrack no longer holds it. */
static __always_inline int podconn_see(struct __sk_buff *skb, struct iphdr *ip, struct tcphdr *tcp, int may_start,
					struct pod_config *cfg)
{
	struct podconn_value *v, fresh = {};
	struct podflow_key key = {};
	struct bpf_sock_tuple tuple = {};
	__u32 side = podflow_key(ip, tcp, &key);
	__u64 len = ip_bytes(skb, ip), now;
	int syn = tcp->syn, ack = tcp->ack, fin = tcp->fin, rst = tcp->rst;
	__u32 seq = tcp->seq, ack_seq = bpf_ntohl(tcp->ack_seq), doff = tcp->doff;

	v = bpf_map_lookup_elem(&agentd_podconns, &key);
	if (!v && !(syn && !ack && !fin && !rst))
		return 0; /* not recorded here: conntrack's events tell of it */
	now = bpf_ktime_get_tai_ns();
	if (syn && !ack && !fin && !rst) {
		/* Sent again: unanswered yet, or its answer lost on the way (the entry is OPEN then,
		 * and must not end as REUSED nor start again when the server answers once more). */
		if (v && v->client == side && v->client_seq == seq && !(v->fins & PODCONN_FIN_LO)) {
			podconn_count(v, side, len, now);
			/* Marked (its conntrack entry, if it makes one, masked as the first's would
			 * have been) where a first SYN would be: the mark also spares it the no-route
			 * rule's route look-up, so the route is asked again. */
			if (podconn_may_mark(skb, ip, tcp, may_start, cfg))
				skb->mark |= POD_RECORD_MARK;
			return 1;
		}
		if (v && v->state != PODCONN_SYN) {
			/* Past the answer (OPEN, CLOSING, a RESET state): a new connection's SYN on
			 * the tuple, or a stray one of this connection (a late duplicate, or one a pod
			 * forged: its peer's TCP answers it with an ACK, and the connection goes on).
			 * Which, the answer tells (PODCONN_NEW_SYN_*: podconn_reopen).  Till then it is
			 * counted here, and marked where a first SYN would be. */
			podconn_count(v, side, len, now);
			__sync_fetch_and_or(&v->fins, side ? PODCONN_NEW_SYN_HI : PODCONN_NEW_SYN_LO);
			if (podconn_may_mark(skb, ip, tcp, may_start, cfg))
				skb->mark |= POD_RECORD_MARK;
			return 1;
		}
		if (v) /* a SYN with a new number before the first's answer: the client tries again */
			bpf_map_delete_elem(&agentd_podconns, &key);
		if (!podconn_may_mark(skb, ip, tcp, may_start, cfg))
			return 0;
		/* Whether conntrack held the connection before this SYN (a SYN sent again whose first
		 * was not recorded: its events were not masked, its NEW is out already) is asked at
		 * the answer, in the one conntrack look-up it makes anyway (podconn_plain: the entry
		 * unmarked), not here: a look-up per SYN cost each node 0.5-0.9 us of program time per
		 * connection (BPF run-time statistics, bench/flows.py's short connections). */
		fresh.state = PODCONN_SYN;
		fresh.client = side;
		fresh.client_seq = seq;
		fresh.first_tai = now;
		fresh.last_tai = now;
		if (side) {
			fresh.packets[1] = 1;
			fresh.bytes[1] = len;
		} else {
			fresh.packets[0] = 1;
			fresh.bytes[0] = len;
		}
		if (bpf_map_update_elem(&agentd_podconns, &key, &fresh, BPF_ANY))
			return 0;
		skb->mark |= POD_RECORD_MARK;
		return 1;
	}
	if (!v)
		return 0;
	if (v->state == PODCONN_SYN) {
		if (side == v->client || (!(syn && ack) && !rst)) {
			/* Not the answer.  Nothing but a SYN of a handshake comes before its answer: a
			 * packet without SYN belongs to a connection past its handshake, or one refused on
			 * the way -- its SYN a stray one (a late duplicate) that found the connection
			 * conntrack's, unmarked.  It stays conntrack's (and its counts podflows'). */
			if (!syn) {
				ct_tuple(&tuple, ip, tcp);
				if (!podconn_plain(skb, &tuple)) {
					bpf_map_delete_elem(&agentd_podconns, &key);
					return 0;
				}
			}
			podconn_count(v, side, len, now);
			return 1;
		}
		ct_tuple(&tuple, ip, tcp);
		if (!podconn_plain(skb, &tuple)) { /* translated, not accepted, or unmasked: conntrack's */
			bpf_map_delete_elem(&agentd_podconns, &key);
			return 0;
		}
		podconn_count(v, side, len, now);
		/* One start: the answer and its retransmission (or a SYN-ACK and a RST) may pass
		 * programs on two CPUs at once; only the one that moves the entry out of PODCONN_SYN
		 * writes it.  The other is counted, and a RST that lost leaves the connection reset,
		 * ended by the agent's sweep as the RST after an answer is (below). */
		if (__sync_val_compare_and_swap(&v->state, PODCONN_SYN, PODCONN_OPEN) != PODCONN_SYN) {
			if (rst)
				podconn_reset(&key, v, side, now);
			return 1;
		}
		podconn_emit(&key, v, PODREC_START);
		if (rst)
			podconn_end(&key, v, PODREC_RST);
		return 1;
	}
	if (v->fins & (side ? PODCONN_NEW_SYN_LO : PODCONN_NEW_SYN_HI)) { /* the answer to the other end's new SYN */
		/* A SYN-ACK: a new connection.  A RST: one refused (a TCP answers a stray SYN on a
		 * connection it holds with a challenge ACK, RFC 5961, never with a RST). */
		if ((syn && ack && !rst && !podconn_answered_again(v, side, ack_seq)) || (rst && !syn))
			return podconn_reopen(skb, ip, tcp, &key, v, side, len, now, ack_seq, rst, &tuple, &fresh);
		if (!syn) /* an ACK: a stray SYN, which ended nothing */
			__sync_fetch_and_and(&v->fins, ~(side ? PODCONN_NEW_SYN_LO : PODCONN_NEW_SYN_HI));
	}
	podconn_count(v, side, len, now);
	if (rst) {
		/* Not ended here: a RST the receiver's TCP finds out of its window it ignores, and the
		 * connection goes on (conntrack, liberal about windows, cannot tell either).  A packet
		 * without RST from the same end afterwards shows that end alive (OPEN again); else the
		 * agent ends the connection as reset, at its last packet (told by a hint: podconn_reset). */
		podconn_reset(&key, v, side, now);
		return 1;
	}
	if (v->state != PODCONN_OPEN && v->state == (side ? PODCONN_RESET_HI : PODCONN_RESET_LO))
		v->state = PODCONN_OPEN; /* that end is alive: anything but RST, a FIN too */
	if (fin || v->fins) /* two compares on an open connection's packets */
		podconn_closing(&key, v, side, fin, ack, ack_seq, bpf_ntohl(seq) + len - sizeof(*ip) - doff * 4 + 1);
	return 1;
}

/* The config, if the packet is a candidate at all and the config has every flag of ``need``:
 * IPv4 TCP, no options, no fragment, no SYN, FIN or RST -- but for a SYN (or SYN-ACK) while
 * the programs count per connection, which is returned with ``*opening`` set (never carried,
 * but it tells that its tuple now belongs to a new connection: podflow_restart).  Packet
 * pointers (``*ipp``, ``*tcpp``): valid until the first helper that changes the packet. */
static __always_inline struct pod_config *candidate(struct __sk_buff *skb, __u32 need, struct iphdr **ipp,
						      struct tcphdr **tcpp, int *opening)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ETH_HLEN;
	struct tcphdr *tcp = data + ETH_HLEN + sizeof(*ip);
	struct pod_config *cfg;
	__u32 zero = 0;

	/* An 802.1Q-tagged frame (the tag already in skb->vlan_tci at tc ingress) is the stack's,
	 * which drops it or hands it to its VLAN's device: carried, it would leave still tagged. */
	if (skb->vlan_present || (void *)(tcp + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return NULL;
	if (ip->version != 4 || ip->ihl != 5 || ip->protocol != IPPROTO_TCP || (ip->frag_off & bpf_htons(IP_MF_OFFSET)))
		return NULL;
	cfg = bpf_map_lookup_elem(&agentd_podcfg, &zero);
	if (!cfg || (cfg->flags & need) != need)
		return NULL;
	*opening = tcp->syn && !tcp->fin && !tcp->rst && (cfg->flags & POD_CFG_COUNT);
	if ((tcp->syn || tcp->fin || tcp->rst) && !*opening) {
		if (!(cfg->flags & POD_CFG_RECORD))
			return NULL;
		*opening = 2; /* a FIN or RST: seen by podconn_see, never carried */
	}
	*ipp = ip;
	*tcpp = tcp;
	return cfg;
}

/* What conntrack says of the connection of ``tuple`` (``size``: of its IPv4 or IPv6 part,
 * which tells bpf_skb_ct_lookup the family): POD_CARRIED if it may be carried. */
static __always_inline __u32 tracked(struct __sk_buff *skb, struct bpf_sock_tuple *tuple, __u32 size,
				     struct pod_config *cfg)
{
	struct ct_opts opts = {.netns_id = CURRENT_NETNS, .l4proto = IPPROTO_TCP};
	unsigned long status;
	struct nf_conn *ct;
	__u8 state;

	ct = bpf_skb_ct_lookup(skb, tuple, size, &opts, sizeof(opts));
	if (!ct)
		return POD_NO_CONNTRACK;
	status = ct->status;
	state = ct->proto.tcp.state;
	/* A helper (FTP, SIP, ...) reads the connection's payload -- a PASV reply, say, becomes
	 * the expectation that makes its data connection RELATED -- and may rewrite it: every
	 * packet must pass it.  Counted with the translated ones: the normal path's. */
	if (status & (IPS_SRC_NAT | IPS_DST_NAT | IPS_HELPER)) {
		bpf_ct_release(ct);
		return POD_NAT;
	}
	if (state != TCP_CONNTRACK_ESTABLISHED) {
		bpf_ct_release(ct);
		return POD_NOT_ESTABLISHED;
	}
	if (cfg->established_ms)
		bpf_ct_change_timeout(ct, cfg->established_ms);
	bpf_ct_release(ct);
	return POD_CARRIED;
}

static __always_inline __u32 accepted(struct __sk_buff *skb, struct iphdr *ip, struct tcphdr *tcp,
				      struct pod_config *cfg)
{
	struct bpf_sock_tuple tuple = {};

	ct_tuple(&tuple, ip, tcp);
	return tracked(skb, &tuple, sizeof(tuple.ipv4), cfg);
}

static __always_inline int in_cluster(struct pod_config *cfg, __be32 addr)
{
	return (addr & cfg->cluster_mask) == cfg->cluster_net;
}

/* ---------------------------------------------------------------- IPv6 */

/* candidate() for IPv6: TCP right behind the IPv6 header (an extension header -- a fragment
 * header among them -- leaves the packet to the stack), no SYN, FIN or RST -- but for a SYN
 * (or SYN-ACK) while the programs count per connection, returned with ``*opening`` set. */
static __always_inline struct pod_config *candidate6(struct __sk_buff *skb, __u32 need, struct ipv6hdr **ipp,
						       struct tcphdr **tcpp, int *opening)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct ipv6hdr *ip = data + ETH_HLEN;
	struct tcphdr *tcp = data + ETH_HLEN + sizeof(*ip);
	struct pod_config *cfg;
	__u32 zero = 0;

	if (skb->vlan_present) /* tagged: the stack's, as in candidate() */
		return NULL;
	if ((void *)(tcp + 1) > end || eth->h_proto != bpf_htons(ETH_P_IPV6) || ip->version != 6 || ip->nexthdr != IPPROTO_TCP)
		return NULL;
	if (tcp->fin || tcp->rst)
		return NULL;
	cfg = bpf_map_lookup_elem(&agentd_podcfg, &zero);
	if (!cfg || (cfg->flags & need) != need)
		return NULL;
	*opening = tcp->syn && (cfg->flags & POD_CFG_COUNT);
	if (tcp->syn && !*opening)
		return NULL;
	*ipp = ip;
	*tcpp = tcp;
	return cfg;
}

/* The packet's addresses and ports as conntrack's tuple and as the two map keys. */
struct flow6 {
	struct bpf_sock_tuple tuple;
	struct pod6_key src, dst;
	__be32 flowinfo;
	__u8 hop_limit;
};

static __always_inline void read_flow6(struct flow6 *f, struct ipv6hdr *ip, struct tcphdr *tcp)
{
	__builtin_memcpy(f->tuple.ipv6.saddr, &ip->saddr, 16);
	__builtin_memcpy(f->tuple.ipv6.daddr, &ip->daddr, 16);
	f->tuple.ipv6.sport = tcp->source;
	f->tuple.ipv6.dport = tcp->dest;
	__builtin_memcpy(f->src.addr, &ip->saddr, 16);
	__builtin_memcpy(f->dst.addr, &ip->daddr, 16);
	f->flowinfo = *(__be32 *)ip & bpf_htonl(IPV6_FLOWINFO_MASK);
	f->hop_limit = ip->hop_limit;
}

/* podflow_key() for IPv6, from the packet's flow6 (which outlives the packet's pointers). */
static __always_inline __u32 podflow6_key(struct flow6 *f, struct podflow6_key *key)
{
	__be16 sp = f->tuple.ipv6.sport, dp = f->tuple.ipv6.dport;
	__u64 s[2], d[2];
	__u32 swap;

	__builtin_memcpy(s, f->src.addr, 16);
	__builtin_memcpy(d, f->dst.addr, 16);
	s[0] = bpf_be64_to_cpu(s[0]);
	s[1] = bpf_be64_to_cpu(s[1]);
	d[0] = bpf_be64_to_cpu(d[0]);
	d[1] = bpf_be64_to_cpu(d[1]);
	if (s[0] != d[0])
		swap = s[0] > d[0];
	else if (s[1] != d[1])
		swap = s[1] > d[1];
	else
		swap = bpf_ntohs(sp) > bpf_ntohs(dp);
	if (swap) {
		__builtin_memcpy(key->addr[0], f->dst.addr, 16);
		__builtin_memcpy(key->addr[1], f->src.addr, 16);
		key->port[0] = dp;
		key->port[1] = sp;
		return 1;
	}
	__builtin_memcpy(key->addr[0], f->src.addr, 16);
	__builtin_memcpy(key->addr[1], f->dst.addr, 16);
	key->port[0] = sp;
	key->port[1] = dp;
	return 0;
}

/* Count a carried IPv6 packet (POD_CFG_COUNT) of ``len`` IP bytes. */
static __always_inline void podflow6_carried(struct pod_config *cfg, struct flow6 *f, __u64 len)
{
	struct podflow6_key key = {};
	__u32 side;

	if (!(cfg->flags & POD_CFG_COUNT))
		return;
	side = podflow6_key(f, &key);
	podflow6_count(&key, side, len);
}

/* podflow_restart() for IPv6: the end goes through the same ring, told apart by its size. */
static __always_inline void podflow6_restart(struct flow6 *f)
{
	struct podflow6_end end = {};
	struct podflow_value *v;

	podflow6_key(f, &end.key);
	v = bpf_map_lookup_elem(&agentd_podflow6, &end.key);
	if (!v)
		return;
	end.value = *v;
	bpf_map_delete_elem(&agentd_podflow6, &end.key);
	bpf_ringbuf_output(&agentd_podends, &end, sizeof(end), BPF_RB_NO_WAKEUP);
}

static __always_inline int in_cluster6(struct pod6_key *addr)
{
	struct pod_config6 *cfg6;
	__u32 zero = 0;
	__u64 a[2], net[2], mask[2];

	cfg6 = bpf_map_lookup_elem(&agentd_podcfg6, &zero);
	if (!cfg6)
		return 0;
	__builtin_memcpy(a, addr->addr, 16);
	__builtin_memcpy(net, cfg6->cluster_net, 16);
	__builtin_memcpy(mask, cfg6->cluster_mask, 16);
	return (a[0] & mask[0]) == net[0] && (a[1] & mask[1]) == net[1];
}

static __always_inline int pod_fast6(struct __sk_buff *skb)
{
	struct bpf_fib_lookup fib = {};
	struct pod_value *src, *dst;
	struct tcphdr *tcp = NULL;
	struct ipv6hdr *ip = NULL;
	struct pod_config *cfg;
	struct flow6 f = {};
	__u32 verdict, ifindex;
	int opening = 0;

	cfg = candidate6(skb, POD_CFG_ON, &ip, &tcp, &opening);
	if (!cfg || !ip || !tcp)
		return PASS;
	read_flow6(&f, ip, tcp);
	src = bpf_map_lookup_elem(&agentd_podips6, &f.src);
	if (!src || src->ifindex != skb->ifindex)
		return PASS; /* not this veth's pod: the normal path's spoofing check judges it */
	if (opening) {
		podflow6_restart(&f);
		return PASS;
	}
	dst = bpf_map_lookup_elem(&agentd_podips6, &f.dst);
	if (dst) { /* a pod of this node */
		ifindex = dst->ifindex;
		verdict = tracked(skb, &f.tuple, sizeof(f.tuple.ipv6), cfg);
		if (verdict != POD_CARRIED)
			return count6(verdict, skb, PASS);
		podflow6_carried(cfg, &f, skb->len - ETH_HLEN);
		return count6(POD_CARRIED, skb, bpf_redirect_peer(ifindex, 0));
	}
	/* A pod of another node: routed as the stack would route it. */
	if (!(cfg->flags & POD_CFG_ROUTE) || !in_cluster6(&f.dst) || f.hop_limit <= 1)
		return PASS;
	fib.family = AF_INET6_;
	fib.flowinfo = f.flowinfo;
	fib.l4_protocol = IPPROTO_TCP;
	fib.sport = f.tuple.ipv6.sport;
	fib.dport = f.tuple.ipv6.dport;
	__builtin_memcpy(fib.ipv6_src, f.src.addr, 16);
	__builtin_memcpy(fib.ipv6_dst, f.dst.addr, 16);
	fib.ifindex = skb->ingress_ifindex;
	verdict = tracked(skb, &f.tuple, sizeof(f.tuple.ipv6), cfg);
	if (verdict != POD_CARRIED)
		return count6(verdict, skb, PASS);
	if (bpf_fib_lookup(skb, &fib, sizeof(fib), 0) != BPF_FIB_LKUP_RET_SUCCESS)
		return count6(POD_NO_ROUTE, skb, PASS); /* no route, not forwarded, no neighbour yet: the stack */
	if (agentd_hop_limit_down(skb, f.hop_limit) || bpf_skb_store_bytes(skb, 0, fib.dmac, ETH_ALEN, 0) ||
	    bpf_skb_store_bytes(skb, ETH_ALEN, fib.smac, ETH_ALEN, 0))
		return count6(POD_NO_ROUTE, skb, PASS);
	podflow6_carried(cfg, &f, skb->len - ETH_HLEN);
	return count6(POD_CARRIED, skb, bpf_redirect(fib.ifindex, 0));
}

static __always_inline int pod_wire6(struct __sk_buff *skb)
{
	struct pod_value *dst;
	struct tcphdr *tcp = NULL;
	struct ipv6hdr *ip = NULL;
	struct pod_config *cfg;
	struct flow6 f = {};
	__u32 verdict, ifindex;
	int opening = 0;

	cfg = candidate6(skb, POD_CFG_ON | POD_CFG_ROUTE, &ip, &tcp, &opening);
	if (!cfg || !ip || !tcp)
		return PASS;
	read_flow6(&f, ip, tcp);
	if (!in_cluster6(&f.src) || f.hop_limit <= 1)
		return PASS;
	if (bpf_map_lookup_elem(&agentd_podips6, &f.src))
		return PASS; /* as in agentd_pod_wire */
	dst = bpf_map_lookup_elem(&agentd_podips6, &f.dst);
	if (!dst)
		return PASS; /* not a pod of this node */
	if (opening) {
		podflow6_restart(&f);
		return PASS;
	}
	ifindex = dst->ifindex;
	verdict = tracked(skb, &f.tuple, sizeof(f.tuple.ipv6), cfg);
	if (verdict != POD_CARRIED)
		return count6(verdict, skb, PASS);
	if (agentd_hop_limit_down(skb, f.hop_limit))
		return count6(POD_NO_ROUTE, skb, PASS);
	podflow6_carried(cfg, &f, skb->len - ETH_HLEN);
	return count6(POD_CARRIED, skb, bpf_redirect_peer(ifindex, 0));
}

/* ---------------------------------------------------------------- the programs */

SEC("tc")
int agentd_pod_fast(struct __sk_buff *skb)
{
	struct bpf_fib_lookup fib = {};
	struct podflow_key key = {};
	struct pod_config *cfg;
	struct pod_value *src, *dst = NULL;
	struct tcphdr *tcp = NULL;
	struct iphdr *ip = NULL;
	__u32 verdict, ifindex, side;
	int opening = 0, recorded = 0;
	__u64 bytes;
	__u8 ttl;

	cfg = candidate(skb, POD_CFG_ON, &ip, &tcp, &opening);
	if (!cfg || !ip || !tcp) /* IPv6 is asked after IPv4: an IPv4 candidate pays nothing for it */
		return skb->protocol == bpf_htons(ETH_P_IPV6) ? pod_fast6(skb) : PASS;
	src = bpf_map_lookup_elem(&agentd_podips, &ip->saddr);
	if (!src || src->ifindex != skb->ifindex)
		return PASS; /* not this veth's pod: the normal path's spoofing check judges it */
	/* Where it goes matters to a packet that may be carried and to a SYN that may start a
	 * record, not to a SYN-ACK, FIN or RST (never carried here). */
	if (!opening || (tcp->syn && !tcp->ack && !tcp->fin && !tcp->rst))
		dst = bpf_map_lookup_elem(&agentd_podips, &ip->daddr);
	if (cfg->flags & POD_CFG_RECORD)
		recorded = podconn_see(skb, ip, tcp, dst ? PODCONN_START : ((cfg->flags & POD_CFG_RECORD_REMOTE) &&
									  in_cluster(cfg, ip->daddr)) ? PODCONN_START_WIRED : 0, cfg);
	if (opening) {
		if (opening == 1 && !recorded) /* a recorded connection counts in podconns, not podflows */
			podflow_restart(ip, tcp);
		return PASS;
	}
	if (dst) { /* a pod of this node */
		ifindex = dst->ifindex;
		verdict = accepted(skb, ip, tcp, cfg);
		if (verdict != POD_CARRIED)
			return count(verdict, skb, PASS);
		if ((cfg->flags & POD_CFG_COUNT) && !recorded) {
			side = podflow_key(ip, tcp, &key);
			podflow_count(&key, side, ip_bytes(skb, ip));
		}
		return count(POD_CARRIED, skb, bpf_redirect_peer(ifindex, 0));
	}
	/* A pod of another node: routed as the stack would route it. */
	if (!(cfg->flags & POD_CFG_ROUTE) || !in_cluster(cfg, ip->daddr) || ip->ttl <= 1)
		return PASS;
	ttl = ip->ttl;
	fib_of(&fib, skb, ip, tcp);
	verdict = accepted(skb, ip, tcp, cfg);
	if (verdict != POD_CARRIED)
		return count(verdict, skb, PASS);
	if (bpf_fib_lookup(skb, &fib, sizeof(fib), 0) != BPF_FIB_LKUP_RET_SUCCESS)
		return count(POD_NO_ROUTE, skb, PASS); /* no route, not forwarded, no neighbour yet: the stack */
	side = podflow_key(ip, tcp, &key); /* the packet pointers die with the first store below */
	bytes = ip_bytes(skb, ip);
	if (agentd_ttl_down(skb, ttl, IPPROTO_TCP) || bpf_skb_store_bytes(skb, 0, fib.dmac, ETH_ALEN, 0) ||
	    bpf_skb_store_bytes(skb, ETH_ALEN, fib.smac, ETH_ALEN, 0))
		return count(POD_NO_ROUTE, skb, PASS);
	if ((cfg->flags & POD_CFG_COUNT) && !recorded)
		podflow_count(&key, side, bytes);
	return count(POD_CARRIED, skb, bpf_redirect(fib.ifindex, 0));
}

SEC("tc")
int agentd_pod_wire(struct __sk_buff *skb)
{
	struct podflow_key key = {};
	struct pod_config *cfg;
	struct pod_value *dst;
	struct tcphdr *tcp = NULL;
	struct iphdr *ip = NULL;
	__u32 verdict, ifindex, side;
	int opening = 0, recorded = 0;
	__u64 bytes;
	__u8 ttl;

	cfg = candidate(skb, POD_CFG_ON | POD_CFG_ROUTE, &ip, &tcp, &opening);
	if (!cfg || !ip || !tcp)
		return skb->protocol == bpf_htons(ETH_P_IPV6) ? pod_wire6(skb) : PASS;
	if (!in_cluster(cfg, ip->saddr) || ip->ttl <= 1)
		return PASS;
	/* A pod of this node's source from the underlay: forged (the pod's packets leave by its
	 * veth) -- the stack judges it, reverse-path filtering included. */
	if (bpf_map_lookup_elem(&agentd_podips, &ip->saddr))
		return PASS;
	dst = bpf_map_lookup_elem(&agentd_podips, &ip->daddr);
	if (!dst)
		return PASS; /* not a pod of this node */
	if (cfg->flags & POD_CFG_RECORD)
		recorded = podconn_see(skb, ip, tcp, PODCONN_START, cfg);
	if (opening) {
		if (opening == 1 && !recorded) /* a recorded connection counts in podconns, not podflows */
			podflow_restart(ip, tcp);
		return PASS;
	}
	ifindex = dst->ifindex;
	ttl = ip->ttl;
	verdict = accepted(skb, ip, tcp, cfg);
	if (verdict != POD_CARRIED)
		return count(verdict, skb, PASS);
	side = podflow_key(ip, tcp, &key); /* the packet pointers die with the store below */
	bytes = ip_bytes(skb, ip);
	if (agentd_ttl_down(skb, ttl, IPPROTO_TCP))
		return count(POD_NO_ROUTE, skb, PASS);
	if ((cfg->flags & POD_CFG_COUNT) && !recorded)
		podflow_count(&key, side, bytes);
	return count(POD_CARRIED, skb, bpf_redirect_peer(ifindex, 0));
}
