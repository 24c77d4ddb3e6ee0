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
 *                    TTL - 1 and into that pod (bpf_redirect_peer).
 *
 * What decides is the kernel's own connection tracking, looked up with the bpf_skb_ct_lookup
 * kfunc: a packet is carried only when
 *   - it is IPv4 TCP without SYN, FIN or RST (those go the normal way, so conntrack sees every
 *     state change of the connection), not a fragment, without IP options;
 *   - from a pod's veth, its source address is that pod's (the anti-spoofing check of the
 *     normal path); between nodes both ends are in the cluster's pod network;
 *   - conntrack has a confirmed entry for it -- confirmed means the normal path, policy
 *     included, accepted the connection's first packet -- in TCP state ESTABLISHED, with no
 *     NAT on it (a Service's translated flow stays on the normal path, which translates).
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
#include <linux/pkt_cls.h>
#include <linux/stddef.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "podpath.h"

#define PASS TC_ACT_UNSPEC
#define IP_MF_OFFSET 0x3fff
#define CURRENT_NETNS -1
#define TCP_CONNTRACK_ESTABLISHED 3 /* enum tcp_conntrack */
#define IPS_SRC_NAT (1UL << 4)
#define IPS_DST_NAT (1UL << 5)
#define AF_INET_ 2

struct ip_ct_tcp {
	__u8 state;
} __attribute__((preserve_access_index));

union nf_conntrack_proto {
	struct ip_ct_tcp tcp;
} __attribute__((preserve_access_index));

struct nf_conn {
	unsigned long status;
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

/* kfuncs are for GPL-compatible programs: dual-licensed as datapath.c is. */
char _license[] SEC("license") = "Dual BSD/GPL";

static __always_inline int count(__u32 verdict, struct __sk_buff *skb, int action)
{
	struct pod_stats *s = bpf_map_lookup_elem(&agentd_podstat, &verdict);

	if (s) {
		s->packets += skb->gso_segs > 1 ? skb->gso_segs : 1;
		s->bytes += skb->len;
	}
	return action;
}

/* The config, if the packet is a candidate at all and the config has every flag of ``need``:
 * IPv4 TCP, no options, no fragment, no SYN, FIN or RST.  Packet pointers (``*ipp``, ``*tcpp``):
 * valid until the first helper that changes the packet. */
static __always_inline struct pod_config *candidate(struct __sk_buff *skb, __u32 need, struct iphdr **ipp,
						      struct tcphdr **tcpp)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ETH_HLEN;
	struct tcphdr *tcp = data + ETH_HLEN + sizeof(*ip);
	struct pod_config *cfg;
	__u32 zero = 0;

	if ((void *)(tcp + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return NULL;
	if (ip->ihl != 5 || ip->protocol != IPPROTO_TCP || (ip->frag_off & bpf_htons(IP_MF_OFFSET)))
		return NULL;
	if (tcp->syn || tcp->fin || tcp->rst)
		return NULL;
	cfg = bpf_map_lookup_elem(&agentd_podcfg, &zero);
	if (!cfg || (cfg->flags & need) != need)
		return NULL;
	*ipp = ip;
	*tcpp = tcp;
	return cfg;
}

/* What conntrack says of the packet's connection: POD_CARRIED if it may be carried. */
static __always_inline __u32 accepted(struct __sk_buff *skb, struct iphdr *ip, struct tcphdr *tcp,
				      struct pod_config *cfg)
{
	struct ct_opts opts = {.netns_id = CURRENT_NETNS, .l4proto = IPPROTO_TCP};
	struct bpf_sock_tuple tuple = {};
	unsigned long status;
	struct nf_conn *ct;
	__u8 state;

	tuple.ipv4.saddr = ip->saddr;
	tuple.ipv4.daddr = ip->daddr;
	tuple.ipv4.sport = tcp->source;
	tuple.ipv4.dport = tcp->dest;
	ct = bpf_skb_ct_lookup(skb, &tuple, sizeof(tuple.ipv4), &opts, sizeof(opts));
	if (!ct)
		return POD_NO_CONNTRACK;
	status = ct->status;
	state = ct->proto.tcp.state;
	if (status & (IPS_SRC_NAT | IPS_DST_NAT)) {
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

static __always_inline int in_cluster(struct pod_config *cfg, __be32 addr)
{
	return (addr & cfg->cluster_mask) == cfg->cluster_net;
}

SEC("tc")
int agentd_pod_fast(struct __sk_buff *skb)
{
	struct bpf_fib_lookup fib = {};
	struct pod_config *cfg;
	struct pod_value *src, *dst;
	struct tcphdr *tcp = NULL;
	struct iphdr *ip = NULL;
	__u32 verdict, ifindex;
	__u8 ttl;

	cfg = candidate(skb, POD_CFG_ON, &ip, &tcp);
	if (!cfg || !ip || !tcp)
		return PASS;
	src = bpf_map_lookup_elem(&agentd_podips, &ip->saddr);
	if (!src || src->ifindex != skb->ifindex)
		return PASS; /* not this veth's pod: the normal path's spoofing check judges it */
	dst = bpf_map_lookup_elem(&agentd_podips, &ip->daddr);
	if (dst) { /* a pod of this node */
		ifindex = dst->ifindex;
		verdict = accepted(skb, ip, tcp, cfg);
		if (verdict != POD_CARRIED)
			return count(verdict, skb, PASS);
		return count(POD_CARRIED, skb, bpf_redirect_peer(ifindex, 0));
	}
	/* A pod of another node: routed as the stack would route it. */
	if (!(cfg->flags & POD_CFG_ROUTE) || !in_cluster(cfg, ip->daddr) || ip->ttl <= 1)
		return PASS;
	ttl = ip->ttl;
	fib.family = AF_INET_;
	fib.tos = ip->tos;
	fib.l4_protocol = IPPROTO_TCP;
	fib.sport = tcp->source;
	fib.dport = tcp->dest;
	fib.ipv4_src = ip->saddr;
	fib.ipv4_dst = ip->daddr;
	fib.ifindex = skb->ingress_ifindex;
	verdict = accepted(skb, ip, tcp, cfg);
	if (verdict != POD_CARRIED)
		return count(verdict, skb, PASS);
	if (bpf_fib_lookup(skb, &fib, sizeof(fib), 0) != BPF_FIB_LKUP_RET_SUCCESS)
		return count(POD_NO_ROUTE, skb, PASS); /* no route, not forwarded, no neighbour yet: the stack */
	if (agentd_ttl_down(skb, ttl, IPPROTO_TCP) || bpf_skb_store_bytes(skb, 0, fib.dmac, ETH_ALEN, 0) ||
	    bpf_skb_store_bytes(skb, ETH_ALEN, fib.smac, ETH_ALEN, 0))
		return count(POD_NO_ROUTE, skb, PASS);
	return count(POD_CARRIED, skb, bpf_redirect(fib.ifindex, 0));
}

SEC("tc")
int agentd_pod_wire(struct __sk_buff *skb)
{
	struct pod_config *cfg;
	struct pod_value *dst;
	struct tcphdr *tcp = NULL;
	struct iphdr *ip = NULL;
	__u32 verdict, ifindex;
	__u8 ttl;

	cfg = candidate(skb, POD_CFG_ON | POD_CFG_ROUTE, &ip, &tcp);
	if (!cfg || !ip || !tcp)
		return PASS;
	if (!in_cluster(cfg, ip->saddr) || ip->ttl <= 1)
		return PASS;
	dst = bpf_map_lookup_elem(&agentd_podips, &ip->daddr);
	if (!dst)
		return PASS; /* not a pod of this node */
	ifindex = dst->ifindex;
	ttl = ip->ttl;
	verdict = accepted(skb, ip, tcp, cfg);
	if (verdict != POD_CARRIED)
		return count(verdict, skb, PASS);
	if (agentd_ttl_down(skb, ttl, IPPROTO_TCP))
		return count(POD_NO_ROUTE, skb, PASS);
	return count(POD_CARRIED, skb, bpf_redirect_peer(ifindex, 0));
}
