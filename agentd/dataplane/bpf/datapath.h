/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The maps shared by datapath.c and the agent (agentd/dataplane/bpf/layout.py mirrors every
 * struct here, and the agent checks the sizes against the object file's map definitions, as
 * libbpf reads them, before it loads it).
 * Addresses and ports are in network byte order, counters in host order.  At the end, the one
 * packet helper datapath.c and podpath.c share.
 */
#ifndef AGENTD_DATAPATH_H
#define AGENTD_DATAPATH_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/stddef.h>
#include <linux/types.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

/* routes: LPM trie, pod subnet -> the peer node that owns it and how to reach it. */
struct route_key {
	__u32 prefixlen; /* LPM trie keys start with the prefix length */
	__be32 addr;
};

enum route_kind {
	KIND_UDP = 1,  /* flannel UDP: outer IPv4 + UDP to config.udp_port, payload = inner packet */
	KIND_IPIP = 2, /* RFC 2003 IP in IP: outer IPv4, protocol 4 */
};

struct route_value {
	__be32 peer; /* the peer's underlay address: the outer destination */
	__u8 kind;   /* enum route_kind */
	__u8 pad[3];
};

/* routes6: LPM trie, IPv6 pod subnet -> the peer node that owns it, with struct route_value:
 * the outer header stays IPv4 (the underlay's).  Only KIND_UDP: flannel UDP's payload is the
 * inner packet, whichever its family; IPIP is IPv4 in IPv4 (RFC 2003), so ipip carries none. */
struct route6_key {
	__u32 prefixlen;
	__u8 addr[16];
};

/* peers: per-CPU hash, peer underlay address -> flags and counters. An entry is a cluster
 * member: encapsulated packets (and VXLAN) from any other source are dropped and counted. */
enum peer_flag {
	/* The peer runs udp/ipip in its user-space worker: this node talks to it through workers
	 * of its own, and the peer's packets go up to those workers' sockets untouched (a worker's
	 * UDP GSO batch cannot be decapsulated as one packet). */
	PEER_F_UDP_TO_WORKER = 1 << 0,
	PEER_F_IPIP_TO_WORKER = 1 << 1,
};

struct peer_stats {
	__u64 flags;      /* enum peer_flag, the same in every CPU's copy (written by the agent) */
	__u64 tx_packets; /* wire packets (a GSO super-packet counts its segments) */
	__u64 tx_bytes;   /* bytes at tc, outer headers included once per super-packet */
	__u64 rx_packets;
	__u64 rx_bytes;
};

/* On an IPv6 underlay (an IPv6-only cluster) the member filter judges IPv6 outer packets:
 * peers6: hash, a member's underlay IPv6 address -> 1;
 * config6: array of one, this node's underlay IPv6 address (all zero: none). */
struct addr6 {
	__u8 addr[16];
};

/* drops: per-CPU array indexed by reason. */
enum drop_reason {
	DROP_NON_MEMBER_UDP = 0,
	DROP_NON_MEMBER_IPIP = 1,
	DROP_NON_MEMBER_VXLAN = 2,
	DROP_MALFORMED = 3,    /* truncated or inconsistent inner packet (e.g. UDP GRO merged several) */
	DROP_TOO_BIG = 4,      /* inner packet + overhead above the underlay MTU (not GSO) */
	DROP_ENCAP_ERROR = 5,  /* bpf_skb_adjust_room refused to grow */
	DROP_DECAP_ERROR = 6,  /* bpf_skb_adjust_room refused to shrink */
	DROP_ECN = 7,          /* RFC 6040 4.2: outer CE on a Not-ECT inner packet */
	DROP_REASONS = 8,
};

struct drop_stats {
	__u64 packets;
	__u64 bytes;
};

/* ports: hash, (bridge, MAC) -> the bridge port behind which that MAC was learned (the
 * bridge's FDB, mirrored by the agent). A decapsulated packet for a pod behind a local bridge
 * goes straight to that port (see deliver_local in datapath.c). */
struct port_key {
	__u32 bridge; /* the bridge's ifindex */
	__u8 mac[6];
	__u8 pad[2];
};

/* config: array of one, written by the agent. */
enum config_flag {
	CFG_DECAP_UDP = 1 << 0,     /* decapsulate flannel UDP to udp_port from members */
	CFG_DECAP_IPIP = 1 << 1,    /* decapsulate IPIP from members */
	CFG_FILTER_VXLAN = 1 << 2,  /* drop UDP to vxlan_port from non-members */
	/* Decapsulation flags of newer kernels: the agent sets both, the program clears the one
	 * its kernel refuses (EINVAL) on the first packet, so /status can tell which it has. */
	CFG_DECAP_L3_FLAG = 1 << 3,  /* BPF_F_ADJ_ROOM_DECAP_L3_IPV4 (Linux 6.3) */
	CFG_DECAP_L4_FLAGS = 1 << 4, /* BPF_F_ADJ_ROOM_DECAP_L4_UDP / _DECAP_IPXIP4 (bpf-next):
				      * the inner packet loses the tunnel GSO type */
	CFG_POD_REDIRECT = 1 << 5,   /* decapsulated packets for pods behind a local bridge go
				      * straight to their bridge port ([network] bpf_pod_redirect) */
	CFG_POD_GATE = 1 << 6,       /* without CFG_POD_REDIRECT, decapsulated packets go on to the
				      * hook's next program, the pod fast path's wire program
				      * (deliver_gated), instead of to the stack */
};

struct config {
	__be32 local;     /* this node's underlay address: the outer source, and the decap target */
	__be16 udp_port;
	__be16 vxlan_port;
	__u32 flags;      /* enum config_flag */
	__u32 mtu;        /* the underlay MTU */
};

/* TTL - 1 with the IPv4 header checksum updated, as a router does, for a packet whose IPv4
 * header follows an Ethernet header (the caller made sure TTL > 1).  0, or -1 when the packet
 * could not be changed.  Used by datapath.c and podpath.c. */
static __always_inline int agentd_ttl_down(struct __sk_buff *skb, __u8 ttl, __u8 protocol)
{
	__u16 old = bpf_htons((__u16)ttl << 8 | protocol), new;

	ttl -= 1;
	new = bpf_htons((__u16)ttl << 8 | protocol);
	if (bpf_l3_csum_replace(skb, ETH_HLEN + offsetof(struct iphdr, check), old, new, 2))
		return -1;
	return bpf_skb_store_bytes(skb, ETH_HLEN + offsetof(struct iphdr, ttl), &ttl, 1, 0) ? -1 : 0;
}

/* Hop limit - 1 for a packet whose IPv6 header follows an Ethernet header (the caller made
 * sure it is above 1): IPv6 has no header checksum, and the hop limit is in no upper-layer
 * pseudo-header (RFC 8200 section 8.1) -- but a NIC's CHECKSUM_COMPLETE sum (skb->csum)
 * covers it, and without BPF_F_RECOMPUTE_CSUM the receiving stack would find that sum wrong
 * ("hw csum failure") on every packet carried.  0, or -1 when the packet could not be changed. */
static __always_inline int agentd_hop_limit_down(struct __sk_buff *skb, __u8 hop_limit)
{
	hop_limit -= 1;
	return bpf_skb_store_bytes(skb, ETH_HLEN + offsetof(struct ipv6hdr, hop_limit), &hop_limit, 1,
				   BPF_F_RECOMPUTE_CSUM) ? -1 : 0;
}

#endif
