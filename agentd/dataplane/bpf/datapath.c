// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* agentd's in-kernel data path: two tc programs (direct action: the return value is the
 * verdict) on the underlay device, attached by tcx or as cls_bpf filters on clsact.
 *
 *   agentd_egress   pod packets routed out of the underlay device toward a pod subnet in the
 *                   routes map (IPv4) or the routes6 map (IPv6) get an outer IPv4 header (+ UDP
 *                   for the udp backend) in place: bpf_skb_adjust_room(ENCAP_L3_IPV4 [|
 *                   ENCAP_L4_UDP] | FIXED_GSO) keeps TCP GSO super-packets whole, of either
 *                   family; the device (or the stack, for a device without tunnel GSO) segments
 *                   them, as it does for kernel VXLAN.
 *   agentd_ingress  flannel UDP (to config.udp_port, an IPv4 or IPv6 inner packet) and IPIP
 *                   (protocol 4, IPv4 inner) from cluster members are decapsulated and handed on
 *                   to the stack (TC_ACT_OK), which forwards the inner packet to the pod, or
 *                   straight to the pod (deliver_local) or to the pod fast path's wire program
 *                   after this one (deliver_gated); from anyone else they are dropped and
 *                   counted, and so is UDP to the VXLAN port (the kernel VXLAN device takes it
 *                   from anyone) -- to whichever address this node takes as its own, not only
 *                   the underlay one (judge).  On an IPv6 underlay it does the same for VXLAN
 *                   in IPv6 (peers6, config6): the member filter of an IPv6-only cluster.
 *
 * A frame with an 802.1Q tag (at tc already in skb->vlan_tci) belongs to another VLAN on the
 * device: neither encapsulated nor decapsulated, only judged by the member filter.
 *
 * Wire formats are the ones the user-space worker and flannel use: flannel UDP is outer IPv4 +
 * UDP whose payload is exactly the inner packet (its version nibble says its family); IPIP is
 * RFC 2003 section 3.1, IPv4 in IPv4 (as Calico's IPIP: IPv6 in IPv4 would be protocol 41,
 * RFC 4213, which no agentd node sends).  The outer header: DF set, TTL 64, DSCP and ECN copied
 * from the inner header (its TOS or traffic class; RFC 6040 section 4.1, normal mode), UDP
 * checksum 0 (RFC 768: none computed), UDP source port from the flow hash (entropy for ECMP
 * and RSS, as the kernel's udp_flow_src_port does).  The outer header is always IPv4: these
 * programs run on an IPv4 underlay (an IPv6 outer packet passes them untouched).
 *
 * The routes that bring pod packets to the underlay device are the agent's kernel routes:
 * IPv4 "subnet via <underlay next hop to the peer> dev <underlay> mtu <underlay mtu - overhead>",
 * so the outer packet leaves toward the same next hop the stack would route it to.  Linux routes
 * IPv6 only through IPv6 next hops, so an IPv6 pod subnet's route is "subnet via ::ffff:<peer>
 * dev <underlay> onlink mtu ..." (the peer's IPv4-mapped address, RFC 4291 section 2.5.5.2,
 * whose permanent neighbour entry the agent keeps), and the program gives the outer packet the
 * MACs of the underlay next hop the stack would send it to (bpf_fib_lookup), or hands it to the
 * neighbour subsystem while that next hop is unresolved (bpf_redirect_neigh).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "datapath.h"

/* linux-libc-dev of Debian 12 is 6.1; these came later. Values from include/uapi/linux/bpf.h. */
#ifndef BPF_F_ADJ_ROOM_DECAP_L3_IPV4
#define BPF_F_ADJ_ROOM_DECAP_L3_IPV4 (1ULL << 7) /* Linux 6.3 */
#define BPF_F_ADJ_ROOM_DECAP_L3_IPV6 (1ULL << 8) /* Linux 6.3: skb->protocol becomes IPv6 */
#endif
#define ADJ_ROOM_DECAP_L4_UDP (1ULL << 10) /* bpf-next: clears the UDP tunnel GSO type */
#define ADJ_ROOM_DECAP_IPXIP4 (1ULL << 11) /* bpf-next: clears SKB_GSO_IPXIP4 */

#define EINVAL 22
#define IP_DF 0x4000
#define IP_MF 0x2000
#define IP_OFFSET 0x1fff
#define IPPROTO_IPIP_ 4
#define OUTER_TTL 64
#define ECN_MASK 3
#define ECN_CE 3
#define MIN_FRAME 60 /* shorter Ethernet frames are padded: their IP length is the truth */
#define IP_MAX_LEN 0xffff
#define AF_INET_ 2
#define AF_INET6_ 10
#define IPV6_FLOWINFO_MASK 0x0fffffff /* traffic class and flow label */
/* A packet that is none of ours: TC_ACT_UNSPEC hands it to the next filter on the hook (or
 * lets it pass where there is none), so that others' programs on the device still see it. */
#define PASS TC_ACT_UNSPEC

/* BTF-defined maps (libbpf's format: the map's shape as the types of its struct's members),
 * pinned by name: the agent points libbpf at this network namespace's pin directory, and a
 * restarted agent's libbpf reuses the maps pinned there -- routes, members and counters
 * survive (see datapath.py). */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct route_key);
	__type(value, struct route_value);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC); /* required for LPM tries */
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_routes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct route6_key);
	__type(value, struct route_value);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_routes6 SEC(".maps");

/* The member maps hold every node of the cluster: as many as the IPv6 pod network's node
 * subnets (docs/networking.md: 65,536 /64s in a /48, the most kube-controller-manager
 * allows).  Not preallocated: an entry takes memory (agentd_peers': one value per CPU) only
 * once a member is there, the hash's buckets 1 MB each. */
#define MEMBERS_MAX 65536

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct addr6);
	__type(value, __u32);
	__uint(max_entries, MEMBERS_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_peers6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct addr6);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_config6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__type(key, __be32);
	__type(value, struct peer_stats);
	__uint(max_entries, MEMBERS_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_peers SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct drop_stats);
	__uint(max_entries, DROP_REASONS);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_drops SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct port_key);
	__type(value, __u32);
	__uint(max_entries, 4096);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct config);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agentd_config SEC(".maps");

/* The kernel lets only GPL-compatible programs call bpf_fib_lookup (deliver_local): this file
 * and datapath.h are dual-licensed, as libbpf and the kernel's BPF samples are; the rest of
 * agentd is Apache-2.0, and the agent only loads this object. */
char _license[] SEC("license") = "Dual BSD/GPL";

struct outer_hdr {
	struct iphdr ip;
	struct udphdr udp;
};
_Static_assert(sizeof(struct outer_hdr) == 28, "outer IPv4 + UDP header");

static __always_inline int drop(__u32 reason, struct __sk_buff *skb)
{
	struct drop_stats *d = bpf_map_lookup_elem(&agentd_drops, &reason);

	if (d) {
		d->packets += 1;
		d->bytes += skb->len;
	}
	return TC_ACT_SHOT;
}

static __always_inline __u32 wire_packets(struct __sk_buff *skb)
{
	return skb->gso_segs > 1 ? skb->gso_segs : 1;
}

static __always_inline __u16 ipv4_csum(struct iphdr *ip)
{
	__u16 *w = (__u16 *)ip;
	__u32 sum = 0;

#pragma unroll
	for (int i = 0; i < (int)(sizeof(*ip) / 2); i++)
		sum += w[i];
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return ~sum;
}

/* Make the first ``len`` bytes linear (a NIC may leave headers in page fragments). */
static __always_inline int pull(struct __sk_buff *skb, __u32 len)
{
	if ((void *)(long)skb->data + len <= (void *)(long)skb->data_end)
		return 0;
	if (skb->len < len)
		return -1;
	return bpf_skb_pull_data(skb, len);
}

/* The outer IPv4 header to ``peer``, ``total`` bytes with it. */
static __always_inline void outer_ip(struct iphdr *ip, struct config *cfg, __be32 peer, __u32 total, __u32 hash,
				     __u8 tos, __u8 protocol)
{
	ip->version = 4;
	ip->ihl = 5;
	ip->tos = tos;
	/* A GSO packet above 64 KB (BIG TCP) carries 0, the stack's own convention (iph_totlen). */
	ip->tot_len = total > IP_MAX_LEN ? 0 : bpf_htons(total);
	ip->id = bpf_htons(hash & 0xffff);
	ip->frag_off = bpf_htons(IP_DF);
	ip->ttl = OUTER_TTL;
	ip->saddr = cfg->local;
	ip->daddr = peer;
	ip->protocol = protocol;
	ip->check = ipv4_csum(ip);
}

/* The outer IPv4 + UDP header of flannel UDP to ``peer``, ``total`` bytes with it. */
static __always_inline void udp_outer(struct outer_hdr *o, struct config *cfg, __be32 peer, __u32 total,
				      __u32 hash, __u8 tos)
{
	outer_ip(&o->ip, cfg, peer, total, hash, tos, IPPROTO_UDP);
	o->udp.source = bpf_htons(0xc000 | ((hash ^ (hash >> 16)) & 0x3fff));
	o->udp.dest = cfg->udp_port;
	o->udp.len = total - sizeof(o->ip) > IP_MAX_LEN ? 0 : bpf_htons(total - sizeof(o->ip));
	o->udp.check = 0;
}

/* An IPv6 pod packet toward a pod subnet in routes6: flannel UDP over the IPv4 underlay.  Its
 * kernel route ("via ::ffff:<peer> ... onlink", see the top) brought it here with the MACs of a
 * neighbour entry that only stands for the peer: once encapsulated, the outer packet gets the
 * MACs of the underlay next hop the stack would send it to. */
static __always_inline int egress6(struct __sk_buff *skb)
{
	struct route6_key key = {.prefixlen = 128};
	struct bpf_fib_lookup fib = {};
	__be16 proto = bpf_htons(ETH_P_IP);
	struct outer_hdr o = {};
	struct route_value *route;
	struct peer_stats *stats;
	struct config *cfg;
	struct ipv6hdr *ip6;
	void *data, *end;
	__u32 zero = 0, inner_len, total, hash, segs;
	__be32 peer;
	__u8 tos;
	long ret;

	if (pull(skb, ETH_HLEN + sizeof(*ip6)))
		return PASS;
	data = (void *)(long)skb->data;
	end = (void *)(long)skb->data_end;
	ip6 = data + ETH_HLEN;
	if ((void *)(ip6 + 1) > end)
		return PASS;
	__builtin_memcpy(key.addr, &ip6->daddr, sizeof(key.addr));
	route = bpf_map_lookup_elem(&agentd_routes6, &key);
	if (!route || route->kind != KIND_UDP)
		return PASS; /* not a pod subnet we encapsulate to (only udp carries IPv6): plain routing */
	cfg = bpf_map_lookup_elem(&agentd_config, &zero);
	if (!cfg || !cfg->local)
		return PASS;
	peer = route->peer;
	tos = ip6->priority << 4 | ip6->flow_lbl[0] >> 4; /* the traffic class: DSCP and ECN */
	inner_len = skb->len - ETH_HLEN;
	total = inner_len + sizeof(o);
	if (!skb->gso_size && total > cfg->mtu)
		return drop(DROP_TOO_BIG, skb);

	hash = bpf_get_hash_recalc(skb);
	segs = wire_packets(skb);
	/* skb->protocol becomes IPv4 with the outer header; the inner one keeps GSO (TCPV6). */
	if (bpf_skb_adjust_room(skb, sizeof(o), BPF_ADJ_ROOM_MAC,
				BPF_F_ADJ_ROOM_ENCAP_L3_IPV4 | BPF_F_ADJ_ROOM_ENCAP_L4_UDP | BPF_F_ADJ_ROOM_FIXED_GSO))
		return drop(DROP_ENCAP_ERROR, skb);
	udp_outer(&o, cfg, peer, total, hash, tos);
	if (bpf_skb_store_bytes(skb, ETH_HLEN, &o, sizeof(o), 0) ||
	    bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_proto), &proto, sizeof(proto), 0))
		return drop(DROP_ENCAP_ERROR, skb);

	/* The underlay next hop toward the peer, as the stack routes what this node sends. */
	fib.family = AF_INET_;
	fib.tos = tos;
	fib.l4_protocol = IPPROTO_UDP;
	fib.ipv4_src = cfg->local;
	fib.ipv4_dst = peer;
	fib.ifindex = skb->ifindex;
	ret = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_OUTPUT);
	if (ret == BPF_FIB_LKUP_RET_NOT_FWDED || ret == BPF_FIB_LKUP_RET_BLACKHOLE ||
	    ret == BPF_FIB_LKUP_RET_UNREACHABLE || ret == BPF_FIB_LKUP_RET_PROHIBIT)
		return drop(DROP_ENCAP_ERROR, skb); /* no route to the peer out of this device */
	stats = bpf_map_lookup_elem(&agentd_peers, &peer);
	if (stats) {
		stats->tx_packets += segs;
		stats->tx_bytes += skb->len;
	}
	if (ret != BPF_FIB_LKUP_RET_SUCCESS)
		/* The next hop not resolved yet (or IPv4 forwarding off, which the lookup needs): the
		 * neighbour subsystem routes the outer packet, queues it and asks. */
		return bpf_redirect_neigh(skb->ifindex, NULL, 0, 0);
	if (bpf_skb_store_bytes(skb, 0, fib.dmac, ETH_ALEN, 0) || bpf_skb_store_bytes(skb, ETH_ALEN, fib.smac, ETH_ALEN, 0))
		return drop(DROP_ENCAP_ERROR, skb);
	return TC_ACT_OK;
}

SEC("tc")
int agentd_egress(struct __sk_buff *skb)
{
	struct route_key key = {.prefixlen = 32};
	struct outer_hdr o = {};
	struct route_value *route;
	struct peer_stats *stats;
	struct config *cfg;
	struct iphdr *ip;
	void *data, *end;
	__u32 zero = 0, inner_len, total, hash, segs;
	__u64 flags;
	__be32 peer;
	__u8 kind, tos;

	if (skb->vlan_present)
		return PASS; /* an 802.1Q-tagged frame (another VLAN on this device): the stack's */
	if (skb->protocol != bpf_htons(ETH_P_IP))
		return skb->protocol == bpf_htons(ETH_P_IPV6) ? egress6(skb) : PASS;
	if (pull(skb, ETH_HLEN + sizeof(*ip)))
		return PASS;
	data = (void *)(long)skb->data;
	end = (void *)(long)skb->data_end;
	ip = data + ETH_HLEN;
	if ((void *)(ip + 1) > end)
		return PASS;
	key.addr = ip->daddr;
	route = bpf_map_lookup_elem(&agentd_routes, &key);
	if (!route)
		return PASS; /* not a pod subnet we encapsulate to: plain routing */
	cfg = bpf_map_lookup_elem(&agentd_config, &zero);
	if (!cfg || !cfg->local)
		return PASS;
	peer = route->peer;
	kind = route->kind;
	tos = ip->tos;
	inner_len = skb->len - ETH_HLEN;

	flags = BPF_F_ADJ_ROOM_ENCAP_L3_IPV4 | BPF_F_ADJ_ROOM_FIXED_GSO;
	if (kind == KIND_UDP) {
		total = inner_len + sizeof(o);
		flags |= BPF_F_ADJ_ROOM_ENCAP_L4_UDP;
	} else if (kind == KIND_IPIP) {
		total = inner_len + sizeof(o.ip);
	} else {
		return PASS;
	}
	/* The route MTU (underlay - overhead) keeps this from happening; a GSO packet's segments
	 * are sized by gso_size, which FIXED_GSO leaves as it is. */
	if (!skb->gso_size && total > cfg->mtu)
		return drop(DROP_TOO_BIG, skb);

	hash = bpf_get_hash_recalc(skb);
	segs = wire_packets(skb); /* adjust_room zeroes gso_segs (to be recomputed): count first */
	if (bpf_skb_adjust_room(skb, total - inner_len, BPF_ADJ_ROOM_MAC, flags))
		return drop(DROP_ENCAP_ERROR, skb);

	if (kind == KIND_UDP) {
		udp_outer(&o, cfg, peer, total, hash, tos);
		if (bpf_skb_store_bytes(skb, ETH_HLEN, &o, sizeof(o), 0))
			return drop(DROP_ENCAP_ERROR, skb);
	} else {
		outer_ip(&o.ip, cfg, peer, total, hash, tos, IPPROTO_IPIP_);
		if (bpf_skb_store_bytes(skb, ETH_HLEN, &o.ip, sizeof(o.ip), 0))
			return drop(DROP_ENCAP_ERROR, skb);
	}
	stats = bpf_map_lookup_elem(&agentd_peers, &peer);
	if (stats) {
		stats->tx_packets += segs;
		stats->tx_bytes += skb->len;
	}
	return TC_ACT_OK;
}

/* Hand a decapsulated packet for a pod behind a bridge on this node straight to the pod's
 * bridge port, as the stack would forward it (FIB lookup, TTL - 1, the neighbour's MAC).
 *
 * Why: on kernels without BPF_F_ADJ_ROOM_DECAP_L4_UDP / _DECAP_IPXIP4 a decapsulated GSO
 * super-packet still says skb->encapsulation, and a bridge device (whose hw_enc_features have
 * no TSO or checksum offload) would segment and checksum it in software on the way out: the
 * kernel VXLAN device clears that state in its own receive path, BPF cannot. The bridge port
 * (a veth) takes the super-packet whole. The cost: these packets skip the host's forwarding
 * path (netfilter FORWARD, the bridge's own device). Anything unusual -- TTL 1, no route, no
 * resolved neighbour, a MAC the bridge has not learned, an MTU problem -- takes the stack's
 * path instead. */
static __always_inline int deliver_local(struct __sk_buff *skb)
{
	struct bpf_fib_lookup fib = {};
	struct port_key pk = {};
	struct iphdr ip;
	__u32 *port;

	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)) || ip.ttl <= 1)
		return TC_ACT_OK;
	fib.family = AF_INET_;
	fib.tos = ip.tos;
	fib.l4_protocol = ip.protocol;
	fib.ipv4_src = ip.saddr;
	fib.ipv4_dst = ip.daddr;
	fib.ifindex = skb->ingress_ifindex;
	if (bpf_fib_lookup(skb, &fib, sizeof(fib), 0) != BPF_FIB_LKUP_RET_SUCCESS)
		return TC_ACT_OK;
	pk.bridge = fib.ifindex;
	__builtin_memcpy(pk.mac, fib.dmac, 6);
	port = bpf_map_lookup_elem(&agentd_ports, &pk);
	if (!port)
		return TC_ACT_OK;
	if (agentd_ttl_down(skb, ip.ttl, ip.protocol) || bpf_skb_store_bytes(skb, 0, fib.dmac, 6, 0) ||
	    bpf_skb_store_bytes(skb, 6, fib.smac, 6, 0))
		return drop(DROP_DECAP_ERROR, skb);
	return bpf_redirect(*port, 0);
}

/* deliver_local for a decapsulated IPv6 packet: the same reasons, the same fall-backs. */
static __always_inline int deliver_local6(struct __sk_buff *skb)
{
	struct bpf_fib_lookup fib = {};
	struct port_key pk = {};
	struct ipv6hdr ip;
	__u32 *port;

	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)) || ip.hop_limit <= 1)
		return TC_ACT_OK;
	fib.family = AF_INET6_;
	fib.flowinfo = *(__be32 *)&ip & bpf_htonl(IPV6_FLOWINFO_MASK);
	fib.l4_protocol = ip.nexthdr;
	__builtin_memcpy(fib.ipv6_src, &ip.saddr, sizeof(fib.ipv6_src));
	__builtin_memcpy(fib.ipv6_dst, &ip.daddr, sizeof(fib.ipv6_dst));
	fib.ifindex = skb->ingress_ifindex;
	if (bpf_fib_lookup(skb, &fib, sizeof(fib), 0) != BPF_FIB_LKUP_RET_SUCCESS)
		return TC_ACT_OK;
	pk.bridge = fib.ifindex;
	__builtin_memcpy(pk.mac, fib.dmac, 6);
	port = bpf_map_lookup_elem(&agentd_ports, &pk);
	if (!port)
		return TC_ACT_OK;
	if (agentd_hop_limit_down(skb, ip.hop_limit) || bpf_skb_store_bytes(skb, 0, fib.dmac, 6, 0) ||
	    bpf_skb_store_bytes(skb, 6, fib.smac, 6, 0))
		return drop(DROP_DECAP_ERROR, skb);
	return bpf_redirect(*port, 0);
}

/* While netfilter must see pod packets here (policy isolating a pod, Services translating,
 * flow records: CFG_POD_REDIRECT is off), a decapsulated packet goes on to the hook's next
 * program instead of straight to the pod: the pod fast path's wire program, which the agent
 * puts after this one (CFG_POD_GATE says it is there).  It takes a packet of a TCP connection
 * conntrack has already accepted -- confirmed, ESTABLISHED, not translated -- into its pod
 * whole (a GSO super-packet stays one, which the stack's bridge would cut: see deliver_local),
 * and lets everything else, the connection's SYN, FIN and RST among it, through to the stack,
 * where netfilter and conntrack see it.  Without it, the stack's path for all. */
static __always_inline int deliver_gated(struct config *cfg)
{
	return (cfg->flags & CFG_POD_GATE) ? PASS : TC_ACT_OK;
}

/* Remove ``outer_len`` bytes of outer headers behind the Ethernet header.
 *
 * Headers at offsets that depend on the packet (IPv4 options) are read and written with
 * bpf_skb_load_bytes / bpf_skb_store_bytes, never through packet pointers: the verifier
 * allows variable offsets on packet pointers only to CAP_PERFMON (its Spectre v1 masking
 * covers stack and map pointers alone), and the agent runs with CAP_BPF + CAP_NET_ADMIN. */
/* bpf_skb_adjust_room(-outer_len) with the decapsulation flags of newer kernels: ``l3`` (the
 * inner family's BPF_F_ADJ_ROOM_DECAP_L3_*: skb->protocol becomes the inner packet's) and
 * ``l4``, each given up (and noted in the config) where this kernel refuses it.  ``*l3_taken``:
 * whether ``l3`` was. */
static __always_inline long shrink(struct __sk_buff *skb, struct config *cfg, __u32 outer_len, __u64 l3, __u64 l4,
				   int *l3_taken)
{
	__u64 flags, extra;
	long ret;

	flags = BPF_F_ADJ_ROOM_FIXED_GSO;
	if (cfg->flags & CFG_DECAP_L3_FLAG)
		flags |= l3;
	extra = (cfg->flags & CFG_DECAP_L4_FLAGS) ? l4 : 0;
	ret = bpf_skb_adjust_room(skb, -(__s32)outer_len, BPF_ADJ_ROOM_MAC, flags | extra);
	if (ret == -EINVAL && extra) {
		/* This kernel predates the flags that clear the tunnel GSO type: note it once.  Atomic:
		 * a plain read-modify-write could put back a bit the agent cleared meanwhile
		 * (CFG_POD_REDIRECT, before it isolates a pod).  A lost race only costs one more try. */
		__sync_fetch_and_and(&cfg->flags, ~CFG_DECAP_L4_FLAGS);
		ret = bpf_skb_adjust_room(skb, -(__s32)outer_len, BPF_ADJ_ROOM_MAC, flags);
	}
	if (ret == -EINVAL && (flags & l3)) {
		__sync_fetch_and_and(&cfg->flags, ~CFG_DECAP_L3_FLAG); /* before Linux 6.3; atomic, as above */
		flags = BPF_F_ADJ_ROOM_FIXED_GSO;
		ret = bpf_skb_adjust_room(skb, -(__s32)outer_len, BPF_ADJ_ROOM_MAC, flags);
	}
	*l3_taken = !!(flags & l3);
	return ret;
}

/* decap for flannel UDP carrying an IPv6 packet: the same checks (RFC 6040 on the traffic
 * class), then the Ethernet header says IPv6, as skb->protocol does after DECAP_L3_IPV6. */
static __always_inline int decap6(struct __sk_buff *skb, struct config *cfg, struct peer_stats *stats,
				  __u32 outer_len, __u8 outer_tos, __u32 segs)
{
	__be16 proto = bpf_htons(ETH_P_IPV6);
	__u32 remaining, inner_tot;
	struct ipv6hdr inner;
	int l3_taken;
	__u8 ecn;

	if (bpf_skb_load_bytes(skb, ETH_HLEN + outer_len, &inner, sizeof(inner)))
		return drop(DROP_MALFORMED, skb);
	remaining = skb->len - ETH_HLEN - outer_len;
	inner_tot = sizeof(inner) + bpf_ntohs(inner.payload_len);
	if (skb->gso_size) {
		/* As in decap; an IPv6 super-packet above 64 KB (BIG TCP) has payload length 0. */
		if (inner_tot != remaining && inner.payload_len)
			return drop(DROP_MALFORMED, skb);
	} else if (inner_tot != remaining) { /* 82 bytes at least: never padded */
		return drop(DROP_MALFORMED, skb);
	}
	ecn = (inner.flow_lbl[0] >> 4) & ECN_MASK; /* the low bits of the traffic class */
	if ((outer_tos & ECN_MASK) == ECN_CE && ecn != ECN_CE) {
		if (!ecn)
			return drop(DROP_ECN, skb);
		inner.flow_lbl[0] |= ECN_CE << 4;
		/* (skb->csum of a CHECKSUM_COMPLETE packet covers the inner header: kept right) */
		if (bpf_skb_store_bytes(skb, ETH_HLEN + outer_len + 1, &inner.flow_lbl[0], 1, BPF_F_RECOMPUTE_CSUM))
			return drop(DROP_DECAP_ERROR, skb);
	}
	if (shrink(skb, cfg, outer_len, BPF_F_ADJ_ROOM_DECAP_L3_IPV6, ADJ_ROOM_DECAP_L4_UDP, &l3_taken) ||
	    bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_proto), &proto, sizeof(proto), 0))
		return drop(DROP_DECAP_ERROR, skb);
	stats->rx_packets += segs;
	stats->rx_bytes += skb->len;
	if (!l3_taken) /* before Linux 6.3 skb->protocol stays IPv4: in again, as what it is now */
		return bpf_redirect(skb->ifindex, BPF_F_INGRESS);
	if (cfg->flags & CFG_POD_REDIRECT)
		return deliver_local6(skb);
	return deliver_gated(cfg);
}

static __always_inline int decap(struct __sk_buff *skb, struct config *cfg, struct peer_stats *stats,
				 __u32 outer_len, __u8 outer_tos, int udp)
{
	__u32 remaining, inner_tot, segs = wire_packets(skb);
	struct iphdr inner;
	int l3_taken;

	if (outer_len > 68) /* 60 bytes of IPv4 header and options + 8 of UDP at most */
		return drop(DROP_MALFORMED, skb);
	if (bpf_skb_load_bytes(skb, ETH_HLEN + outer_len, &inner, sizeof(inner)))
		return drop(DROP_MALFORMED, skb);
	if (inner.version == 6 && udp) /* IPIP is IPv4 in IPv4 only */
		return decap6(skb, cfg, stats, outer_len, outer_tos, segs);
	if (inner.version != 4 || inner.ihl < 5)
		return drop(DROP_MALFORMED, skb);
	remaining = skb->len - ETH_HLEN - outer_len;
	inner_tot = bpf_ntohs(inner.tot_len);
	if (skb->gso_size) {
		/* A super-packet from a peer's GSO (veth) or the NIC's GRO: its inner length is the
		 * whole. UDP GRO (rx-udp-gro-forwarding) glues several datagrams, each with its own
		 * inner packet, behind one outer header: not decapsulable as one. */
		if (inner_tot != remaining && inner_tot != 0)
			return drop(DROP_MALFORMED, skb);
	} else if (inner_tot > remaining || (inner_tot < remaining && skb->len > MIN_FRAME)) {
		return drop(DROP_MALFORMED, skb);
	}
	/* RFC 6040 section 4.2: congestion experienced on the outer header carries over to an
	 * ECN-capable inner packet, and drops a Not-ECT one. */
	if ((outer_tos & ECN_MASK) == ECN_CE && (inner.tos & ECN_MASK) != ECN_CE) {
		__u16 old = *(__u16 *)&inner, new;

		if (!(inner.tos & ECN_MASK))
			return drop(DROP_ECN, skb);
		inner.tos |= ECN_CE;
		new = *(__u16 *)&inner;
		if (bpf_l3_csum_replace(skb, ETH_HLEN + outer_len + 10, old, new, 2) ||
		    bpf_skb_store_bytes(skb, ETH_HLEN + outer_len + 1, &inner.tos, 1, 0))
			return drop(DROP_DECAP_ERROR, skb);
	}

	if (shrink(skb, cfg, outer_len, BPF_F_ADJ_ROOM_DECAP_L3_IPV4,
		   udp ? ADJ_ROOM_DECAP_L4_UDP : ADJ_ROOM_DECAP_IPXIP4, &l3_taken))
		return drop(DROP_DECAP_ERROR, skb);
	stats->rx_packets += segs;
	stats->rx_bytes += skb->len;
	if (cfg->flags & CFG_POD_REDIRECT)
		return deliver_local(skb);
	return deliver_gated(cfg);
}

#define NEXTHDR_HOP 0
#define NEXTHDR_ROUTING 43
#define NEXTHDR_FRAGMENT 44
#define NEXTHDR_DEST 60
#define IPV6_EXT_MAX 6      /* extension headers walked before the UDP header */
#define IPV6_FRAG_OFFSET 0xfff8

/* Whether the stack takes an IPv4 packet to ``daddr`` (with ``fib``'s other fields filled) for
 * this node rather than forwarding it.  The kernel's VXLAN socket is bound to the wildcard
 * address and finds its device by the VNI alone, and UDP delivers to it whatever this node
 * takes as its own: any of its addresses on any device (the underlay's, a secondary one, a
 * pod gateway's, docker0's), a broadcast address, a multicast group it is in.  So the member
 * filter judges all of that, and leaves alone only what the stack would forward (a pod's
 * packet, someone else's tunnel through this node): bpf_fib_lookup answers as the stack's
 * routing does (a local or broadcast route: NOT_FWDED).  Forwarding off, or a route that
 * drops the packet: the stack forwards nothing of it, so judging it costs nothing. */
static __always_inline int fib_forwards(struct __sk_buff *skb, struct bpf_fib_lookup *fib)
{
	long ret;

	fib->ifindex = skb->ingress_ifindex;
	ret = bpf_fib_lookup(skb, fib, sizeof(*fib), 0);
	return ret == BPF_FIB_LKUP_RET_SUCCESS || ret == BPF_FIB_LKUP_RET_NO_NEIGH || ret == BPF_FIB_LKUP_RET_FRAG_NEEDED ||
	       ret == BPF_FIB_LKUP_RET_UNSUPP_LWT;
}

/* Drop (and count under ``reason``) a non-member's packet to a port or protocol the member
 * filter protects, unless the stack would forward it (see fib_forwards). */
static __always_inline int judge(struct __sk_buff *skb, struct config *cfg, struct iphdr *ip, struct udphdr *udp,
				 __u32 reason)
{
	struct bpf_fib_lookup fib = {};

	if (ip->daddr == cfg->local)
		return drop(reason, skb);
	/* Multicast and the limited broadcast are taken (or not) before any route is looked up. */
	if ((ip->daddr & bpf_htonl(0xf0000000)) == bpf_htonl(0xe0000000) || ip->daddr == 0xffffffff)
		return drop(reason, skb);
	fib.family = AF_INET_;
	fib.tos = ip->tos;
	fib.l4_protocol = ip->protocol;
	if (udp) {
		fib.sport = udp->source;
		fib.dport = udp->dest;
	}
	fib.ipv4_src = ip->saddr;
	fib.ipv4_dst = ip->daddr;
	return fib_forwards(skb, &fib) ? PASS : drop(reason, skb);
}

static __always_inline int ipv6_ext(__u8 nexthdr)
{
	return nexthdr == NEXTHDR_HOP || nexthdr == NEXTHDR_ROUTING || nexthdr == NEXTHDR_DEST ||
	       nexthdr == NEXTHDR_FRAGMENT;
}

/* judge for IPv6: this node's underlay address (``local``), a multicast group, or whatever
 * else the stack would not forward (any local address, an anycast one). */
static __always_inline int judge6(struct __sk_buff *skb, struct ipv6hdr *ip, __u64 *dst, __u64 *local, __u8 l4,
				  struct udphdr *udp, __u32 reason)
{
	struct bpf_fib_lookup fib = {};

	if ((dst[0] == local[0] && dst[1] == local[1]) || ip->daddr.in6_u.u6_addr8[0] == 0xff)
		return drop(reason, skb);
	fib.family = AF_INET6_;
	fib.flowinfo = *(__be32 *)ip & bpf_htonl(IPV6_FLOWINFO_MASK);
	fib.l4_protocol = l4;
	if (udp) {
		fib.sport = udp->source;
		fib.dport = udp->dest;
	}
	__builtin_memcpy(fib.ipv6_src, &ip->saddr, sizeof(fib.ipv6_src));
	__builtin_memcpy(fib.ipv6_dst, &ip->daddr, sizeof(fib.ipv6_dst));
	return fib_forwards(skb, &fib) ? PASS : drop(reason, skb);
}

/* The member filter on an IPv6 underlay: VXLAN that this node takes (see judge) from anyone
 * but a member is dropped and counted.  The UDP header is looked for behind the extension
 * headers a sender may put first (the stack walks them and delivers to the VXLAN socket all
 * the same); a later fragment has no port to check -- reassembly needs the first one, which is
 * checked -- and more extension headers than any agentd node sends, which hide whether it is
 * UDP, is dropped as malformed.  An 802.1Q-tagged frame is judged as well: the stack takes
 * one with VLAN id 0 (a priority tag) as untagged. */
static __always_inline int ingress6(struct __sk_buff *skb)
{
	struct {
		__u8 nexthdr;
		__u8 hdrlen;
		__be16 frag_off; /* a fragment header's; other headers' first option bytes */
	} ext;
	__u64 dst[2], local[2];
	struct config *cfg;
	struct addr6 *cfg6;
	struct ipv6hdr ip;
	struct udphdr udp;
	__u32 zero = 0, off = ETH_HLEN + sizeof(ip);
	__u8 nexthdr;

	cfg = bpf_map_lookup_elem(&agentd_config, &zero);
	cfg6 = bpf_map_lookup_elem(&agentd_config6, &zero);
	if (!cfg || !cfg6 || !(cfg->flags & CFG_FILTER_VXLAN))
		return PASS;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)))
		return PASS;
	__builtin_memcpy(dst, &ip.daddr, sizeof(dst));
	__builtin_memcpy(local, cfg6->addr, sizeof(local));
	if (!(local[0] | local[1]))
		return PASS; /* not on an IPv6 underlay */
	nexthdr = ip.nexthdr;
	for (int i = 0; i < IPV6_EXT_MAX && nexthdr != IPPROTO_UDP; i++) {
		if (!ipv6_ext(nexthdr))
			return PASS; /* not UDP */
		if (bpf_skb_load_bytes(skb, off, &ext, sizeof(ext)))
			return PASS;
		if (nexthdr == NEXTHDR_FRAGMENT) {
			if (ext.frag_off & bpf_htons(IPV6_FRAG_OFFSET))
				return PASS;
			off += 8;
		} else {
			off += ((__u32)ext.hdrlen + 1) * 8;
		}
		nexthdr = ext.nexthdr;
	}
	if (nexthdr != IPPROTO_UDP) {
		if (!ipv6_ext(nexthdr))
			return PASS; /* not UDP, behind the most extension headers walked */
		return judge6(skb, &ip, dst, local, nexthdr, NULL, DROP_MALFORMED);
	}
	if (bpf_skb_load_bytes(skb, off, &udp, sizeof(udp)) || udp.dest != cfg->vxlan_port)
		return PASS;
	if (bpf_map_lookup_elem(&agentd_peers6, &ip.saddr))
		return PASS;
	return judge6(skb, &ip, dst, local, IPPROTO_UDP, &udp, DROP_NON_MEMBER_VXLAN);
}

SEC("tc")
int agentd_ingress(struct __sk_buff *skb)
{
	struct peer_stats *stats;
	struct config *cfg;
	struct udphdr udp;
	struct iphdr ip;
	__u32 zero = 0, hlen;
	int first_fragment, fragment, ours;

	if (skb->protocol != bpf_htons(ETH_P_IP))
		return skb->protocol == bpf_htons(ETH_P_IPV6) ? ingress6(skb) : PASS;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)))
		return PASS;
	if (ip.protocol != IPPROTO_UDP && ip.protocol != IPPROTO_IPIP_)
		return PASS;
	cfg = bpf_map_lookup_elem(&agentd_config, &zero);
	if (!cfg || !cfg->local)
		return PASS;
	hlen = ip.ihl * 4;
	if (hlen < sizeof(ip))
		return PASS; /* the stack drops it */
	/* Decapsulated here: what members send, untagged to the underlay address.  A non-member's
	 * packet is judged wherever it goes (judge: to any address this node takes as its own),
	 * and tagged (802.1Q) as well: the stack takes a frame with VLAN id 0 (a priority tag) as
	 * untagged.  A member's tagged one, or one to another of this node's addresses, goes the
	 * stack's way. */
	ours = ip.daddr == cfg->local && !skb->vlan_present;
	fragment = ip.frag_off & bpf_htons(IP_MF | IP_OFFSET);
	first_fragment = !(ip.frag_off & bpf_htons(IP_OFFSET));
	stats = bpf_map_lookup_elem(&agentd_peers, &ip.saddr);

	if (ip.protocol == IPPROTO_IPIP_) {
		if (!(cfg->flags & CFG_DECAP_IPIP))
			return PASS; /* not ours: ipip is not carried here, or by the user-space worker */
		if (!stats)
			return judge(skb, cfg, &ip, NULL, DROP_NON_MEMBER_IPIP);
		if (!ours || (stats->flags & PEER_F_IPIP_TO_WORKER))
			return PASS; /* (for this node's worker, which speaks to that peer) */
		if (fragment) /* our peers set DF: a fragment is not theirs to send */
			return drop(DROP_MALFORMED, skb);
		return decap(skb, cfg, stats, hlen, ip.tos, 0);
	}

	/* UDP. A later fragment has no port to check: reassembly needs the first one, which is. */
	if (!first_fragment)
		return PASS;
	if (bpf_skb_load_bytes(skb, ETH_HLEN + hlen, &udp, sizeof(udp)))
		return PASS;
	if (udp.dest == cfg->udp_port && (cfg->flags & CFG_DECAP_UDP)) {
		if (!stats)
			return judge(skb, cfg, &ip, &udp, DROP_NON_MEMBER_UDP);
		if (!ours || (stats->flags & PEER_F_UDP_TO_WORKER))
			return PASS; /* (for this node's worker, which speaks to that peer) */
		if (fragment)
			return drop(DROP_MALFORMED, skb);
		return decap(skb, cfg, stats, hlen + sizeof(udp), ip.tos, 1);
	}
	if (udp.dest == cfg->vxlan_port && (cfg->flags & CFG_FILTER_VXLAN) && !stats)
		return judge(skb, cfg, &ip, &udp, DROP_NON_MEMBER_VXLAN);
	return PASS;
}
