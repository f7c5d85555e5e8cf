//go:build cgo && gdrlink_ibverbs

package ibv

/*
#cgo LDFLAGS: -libverbs
#include <infiniband/verbs.h>
#include <endian.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

// Flat work requests and completions: Go fills and reads these (they hold no
// pointers), the shims turn them into libibverbs' linked structures on the C
// stack, so one cgo call carries a whole chain or a whole batch.
typedef struct {
	uint64_t wr_id;
	uint64_t remote_addr;
	uint32_t rkey;
	uint32_t imm;
	uint32_t opcode;
	uint32_t flags;
	uint32_t num_sge;
	uint32_t sge_off;
} gdr_send_wr;

typedef struct {
	uint64_t wr_id;
	uint32_t num_sge;
	uint32_t sge_off;
} gdr_recv_wr;

typedef struct {
	uint64_t wr_id;
	uint32_t status;
	uint32_t opcode;
	uint32_t vendor_err;
	uint32_t byte_len;
	uint32_t imm;
	uint32_t qp_num;
	uint32_t wc_flags;
	uint32_t pad;
} gdr_wc;

#define GDR_CHUNK 32

static uint64_t gdr_be64(uint64_t v) { return be64toh(v); }

static int gdr_err(int rc) { return rc < 0 ? (errno ? errno : EIO) : rc; }

// gdr_post_send posts n work requests in chunks of GDR_CHUNK linked requests.
// It returns 0 or an errno; *bad is the index of the first request not posted.
static int gdr_post_send(struct ibv_qp *qp, gdr_send_wr *w, int n, struct ibv_sge *sg, int *bad) {
	struct ibv_send_wr wr[GDR_CHUNK];
	int done = 0;
	while (done < n) {
		int k = n - done;
		if (k > GDR_CHUNK) k = GDR_CHUNK;
		memset(wr, 0, sizeof(wr[0]) * k);
		for (int i = 0; i < k; i++) {
			gdr_send_wr *s = &w[done + i];
			wr[i].wr_id = s->wr_id;
			wr[i].next = i + 1 < k ? &wr[i + 1] : NULL;
			wr[i].sg_list = s->num_sge ? &sg[s->sge_off] : NULL;
			wr[i].num_sge = (int)s->num_sge;
			wr[i].opcode = (enum ibv_wr_opcode)s->opcode;
			wr[i].send_flags = s->flags;
			wr[i].imm_data = htobe32(s->imm);
			wr[i].wr.rdma.remote_addr = s->remote_addr;
			wr[i].wr.rdma.rkey = s->rkey;
		}
		struct ibv_send_wr *badwr = NULL;
		errno = 0;
		int rc = ibv_post_send(qp, wr, &badwr);
		if (rc) {
			*bad = done + (badwr ? (int)(badwr - wr) : 0);
			return gdr_err(rc);
		}
		done += k;
	}
	*bad = n;
	return 0;
}

static int gdr_post_recv(struct ibv_qp *qp, gdr_recv_wr *w, int n, struct ibv_sge *sg, int *bad) {
	struct ibv_recv_wr wr[GDR_CHUNK];
	int done = 0;
	while (done < n) {
		int k = n - done;
		if (k > GDR_CHUNK) k = GDR_CHUNK;
		for (int i = 0; i < k; i++) {
			gdr_recv_wr *s = &w[done + i];
			wr[i].wr_id = s->wr_id;
			wr[i].next = i + 1 < k ? &wr[i + 1] : NULL;
			wr[i].sg_list = s->num_sge ? &sg[s->sge_off] : NULL;
			wr[i].num_sge = (int)s->num_sge;
		}
		struct ibv_recv_wr *badwr = NULL;
		errno = 0;
		int rc = ibv_post_recv(qp, wr, &badwr);
		if (rc) {
			*bad = done + (badwr ? (int)(badwr - wr) : 0);
			return gdr_err(rc);
		}
		done += k;
	}
	*bad = n;
	return 0;
}

// gdr_poll_cq polls up to n completions; it returns how many, or -errno.
static int gdr_poll_cq(struct ibv_cq *cq, gdr_wc *out, int n) {
	struct ibv_wc wc[GDR_CHUNK];
	int total = 0;
	while (total < n) {
		int k = n - total;
		if (k > GDR_CHUNK) k = GDR_CHUNK;
		int got = ibv_poll_cq(cq, k, wc);
		if (got < 0) return total ? total : -EIO;
		for (int i = 0; i < got; i++) {
			gdr_wc *o = &out[total + i];
			o->wr_id = wc[i].wr_id;
			o->status = wc[i].status;
			o->opcode = wc[i].opcode;
			o->vendor_err = wc[i].vendor_err;
			o->byte_len = wc[i].byte_len;
			o->imm = (wc[i].wc_flags & IBV_WC_WITH_IMM) ? be32toh(wc[i].imm_data) : 0;
			o->qp_num = wc[i].qp_num;
			o->wc_flags = wc[i].wc_flags;
			o->pad = 0;
		}
		total += got;
		if (got < k) break;
	}
	return total;
}

static int gdr_req_notify(struct ibv_cq *cq) { return gdr_err(ibv_req_notify_cq(cq, 0)); }

static int gdr_get_cq_event(struct ibv_comp_channel *ch, struct ibv_cq **cq) {
	void *ctx = NULL;
	errno = 0;
	if (ibv_get_cq_event(ch, cq, &ctx)) return errno ? errno : EIO;
	return 0;
}

static int gdr_query_port(struct ibv_context *c, int port, struct ibv_port_attr *a) {
	memset(a, 0, sizeof(*a));
	return gdr_err(ibv_query_port(c, (uint8_t)port, a));
}

static int gdr_query_gid_ex(struct ibv_context *c, int port, int index, uint8_t *gid, int *type) {
	struct ibv_gid_entry e;
	memset(&e, 0, sizeof(e));
	errno = 0;
	int rc = ibv_query_gid_ex(c, (uint32_t)port, (uint32_t)index, &e, 0);
	if (rc) return gdr_err(rc);
	memcpy(gid, e.gid.raw, 16);
	*type = (int)e.gid_type;
	return 0;
}

static ssize_t gdr_query_gid_table(struct ibv_context *c, struct ibv_gid_entry *e, size_t n) {
	errno = 0;
	ssize_t got = ibv_query_gid_table(c, e, n, 0);
	if (got < 0) return -(errno ? errno : (got < -1 ? -got : EIO));
	return got;
}

static int gdr_query_gid(struct ibv_context *c, int port, int index, uint8_t *gid) {
	union ibv_gid g;
	errno = 0;
	int rc = ibv_query_gid(c, (uint8_t)port, index, &g);
	if (rc) return gdr_err(rc);
	memcpy(gid, g.raw, 16);
	return 0;
}

static struct ibv_qp *gdr_create_qp(struct ibv_pd *pd, struct ibv_cq *scq, struct ibv_cq *rcq,
                                    int sw, int rw, int ssge, int rsge, int inl, int *caps) {
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof(a));
	a.send_cq = scq;
	a.recv_cq = rcq;
	a.qp_type = IBV_QPT_RC;
	a.sq_sig_all = 0;
	a.cap.max_send_wr = sw;
	a.cap.max_recv_wr = rw;
	a.cap.max_send_sge = ssge;
	a.cap.max_recv_sge = rsge;
	a.cap.max_inline_data = inl;
	errno = 0;
	struct ibv_qp *qp = ibv_create_qp(pd, &a);
	if (qp) {
		caps[0] = a.cap.max_send_wr;
		caps[1] = a.cap.max_recv_wr;
		caps[2] = a.cap.max_send_sge;
		caps[3] = a.cap.max_recv_sge;
		caps[4] = a.cap.max_inline_data;
	}
	return qp;
}

static int gdr_qp_init(struct ibv_qp *qp, int port, int pkey, int access) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.pkey_index = (uint16_t)pkey;
	a.port_num = (uint8_t)port;
	a.qp_access_flags = access;
	return gdr_err(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS));
}

static int gdr_qp_rtr(struct ibv_qp *qp, uint32_t dqpn, uint32_t rq_psn, int mtu, int global,
                      uint8_t *dgid, int sgid_index, int hop, int tclass, int dlid, int sl,
                      int port, int max_dest_rd_atomic, int min_rnr_timer) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = (enum ibv_mtu)mtu;
	a.dest_qp_num = dqpn;
	a.rq_psn = rq_psn;
	a.max_dest_rd_atomic = (uint8_t)max_dest_rd_atomic;
	a.min_rnr_timer = (uint8_t)min_rnr_timer;
	a.ah_attr.dlid = (uint16_t)dlid;
	a.ah_attr.sl = (uint8_t)sl;
	a.ah_attr.src_path_bits = 0;
	a.ah_attr.port_num = (uint8_t)port;
	if (global) {
		a.ah_attr.is_global = 1;
		memcpy(a.ah_attr.grh.dgid.raw, dgid, 16);
		a.ah_attr.grh.sgid_index = (uint8_t)sgid_index;
		a.ah_attr.grh.hop_limit = (uint8_t)hop;
		a.ah_attr.grh.traffic_class = (uint8_t)tclass;
		a.ah_attr.grh.flow_label = 0;
	}
	return gdr_err(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
	                                     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER));
}

static int gdr_qp_rts(struct ibv_qp *qp, uint32_t sq_psn, int timeout, int retry, int rnr, int max_rd_atomic) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = sq_psn;
	a.timeout = (uint8_t)timeout;
	a.retry_cnt = (uint8_t)retry;
	a.rnr_retry = (uint8_t)rnr;
	a.max_rd_atomic = (uint8_t)max_rd_atomic;
	return gdr_err(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
	                                     IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC));
}

static int gdr_qp_err(struct ibv_qp *qp) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_ERR;
	return gdr_err(ibv_modify_qp(qp, &a, IBV_QP_STATE));
}

static int gdr_qp_state(struct ibv_qp *qp, int *state) {
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr ia;
	errno = 0;
	int rc = ibv_query_qp(qp, &a, IBV_QP_STATE, &ia);
	if (rc) return gdr_err(rc);
	*state = a.qp_state;
	return 0;
}

static struct ibv_mr *gdr_reg_mr(struct ibv_pd *pd, uintptr_t addr, size_t len, int access) {
	errno = 0;
	return ibv_reg_mr(pd, (void *)addr, len, access);
}

static struct ibv_mr *gdr_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t off, size_t len, uint64_t iova, int fd, int access) {
	errno = 0;
	return ibv_reg_dmabuf_mr(pd, off, len, iova, fd, access);
}
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Available reports whether the package was built with libibverbs.
const Available = true

func errnoOf(rc C.int) syscall.Errno {
	if rc < 0 {
		rc = -rc
	}
	if rc == 0 {
		return syscall.EIO
	}
	return syscall.Errno(rc)
}

// lastErrno turns the errno of a verb that returned NULL into an Errno.
func lastErrno(err error) syscall.Errno {
	var e syscall.Errno
	if errors.As(err, &e) && e != 0 {
		return e
	}
	return syscall.EIO
}

// Devices lists the RDMA devices libibverbs sees. An empty list with a nil
// error means libibverbs works but found none.
func Devices() ([]DeviceInfo, error) {
	var n C.int
	list, err := C.ibv_get_device_list(&n)
	if list == nil {
		return nil, &Error{Op: "ibv_get_device_list", Errno: lastErrno(err)}
	}
	defer C.ibv_free_device_list(list)
	devs := unsafe.Slice(list, int(n))
	out := make([]DeviceInfo, 0, len(devs))
	for _, d := range devs {
		out = append(out, DeviceInfo{
			Name:      C.GoString(C.ibv_get_device_name(d)),
			NodeGUID:  uint64(C.gdr_be64(C.uint64_t(C.ibv_get_device_guid(d)))),
			Transport: int(d.transport_type),
		})
	}
	return out, nil
}

// Context is an open device.
type Context struct {
	name string
	cnt  *Counters

	mu  sync.Mutex
	ctx *C.struct_ibv_context
}

// Open opens the device called name.
func Open(name string) (*Context, error) {
	var n C.int
	list, err := C.ibv_get_device_list(&n)
	if list == nil {
		return nil, &Error{Op: "ibv_get_device_list", Errno: lastErrno(err)}
	}
	defer C.ibv_free_device_list(list)
	for _, d := range unsafe.Slice(list, int(n)) {
		if C.GoString(C.ibv_get_device_name(d)) != name {
			continue
		}
		ctx, err := C.ibv_open_device(d)
		if ctx == nil {
			return nil, &Error{Op: "ibv_open_device", Device: name, Errno: lastErrno(err)}
		}
		return &Context{name: name, cnt: new(Counters), ctx: ctx}, nil
	}
	return nil, &Error{Op: "ibv_open_device", Device: name, Errno: syscall.ENODEV}
}

// Name is the device's name.
func (c *Context) Name() string { return c.name }

// Counters are the context's cgo crossing counters, shared by everything
// made from it.
func (c *Context) Counters() *Counters { return c.cnt }

func (c *Context) errf(op string, e syscall.Errno, format string, args ...any) error {
	return &Error{Op: op, Device: c.name, Errno: e, Detail: fmt.Sprintf(format, args...)}
}

// live returns the C context or an EBADF error once closed.
func (c *Context) live(op string) (*C.struct_ibv_context, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctx == nil {
		return nil, &Error{Op: op, Device: c.name, Errno: syscall.EBADF, Detail: "device closed"}
	}
	return c.ctx, nil
}

// Close closes the device. Idempotent. It fails (EBUSY) while resources
// made from it live.
func (c *Context) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctx == nil {
		return nil
	}
	c.cnt.control.Add(1)
	if rc := C.ibv_close_device(c.ctx); rc != 0 {
		return c.errf("ibv_close_device", errnoOf(rc), "")
	}
	c.ctx = nil
	return nil
}

// QueryDevice reads the device's limits.
func (c *Context) QueryDevice() (DeviceAttr, error) {
	ctx, err := c.live("ibv_query_device")
	if err != nil {
		return DeviceAttr{}, err
	}
	var a C.struct_ibv_device_attr
	c.cnt.control.Add(1)
	if rc := C.ibv_query_device(ctx, &a); rc != 0 {
		return DeviceAttr{}, c.errf("ibv_query_device", errnoOf(rc), "")
	}
	return DeviceAttr{
		FWVersion:       C.GoString(&a.fw_ver[0]),
		NodeGUID:        uint64(C.gdr_be64(C.uint64_t(a.node_guid))),
		VendorID:        uint32(a.vendor_id),
		VendorPartID:    uint32(a.vendor_part_id),
		MaxMRSize:       uint64(a.max_mr_size),
		MaxQP:           int(a.max_qp),
		MaxQPWR:         int(a.max_qp_wr),
		MaxSGE:          int(a.max_sge),
		MaxCQ:           int(a.max_cq),
		MaxCQE:          int(a.max_cqe),
		MaxMR:           int(a.max_mr),
		MaxPD:           int(a.max_pd),
		MaxQPRdAtom:     int(a.max_qp_rd_atom),
		MaxQPInitRdAtom: int(a.max_qp_init_rd_atom),
		PhysPortCount:   int(a.phys_port_cnt),
	}, nil
}

// QueryPort reads a port's state (ports count from 1).
func (c *Context) QueryPort(port int) (PortAttr, error) {
	ctx, err := c.live("ibv_query_port")
	if err != nil {
		return PortAttr{}, err
	}
	if port < 1 || port > 255 {
		return PortAttr{}, c.errf("ibv_query_port", syscall.EINVAL, "port %d", port)
	}
	var a C.struct_ibv_port_attr
	c.cnt.control.Add(1)
	if rc := C.gdr_query_port(ctx, C.int(port), &a); rc != 0 {
		return PortAttr{}, c.errf("ibv_query_port", errnoOf(rc), "port %d", port)
	}
	return PortAttr{
		State:      int(a.state),
		MaxMTU:     MTUBytes(int(a.max_mtu)),
		ActiveMTU:  MTUBytes(int(a.active_mtu)),
		GIDTblLen:  int(a.gid_tbl_len),
		PKeyTblLen: int(a.pkey_tbl_len),
		MaxMsgSize: uint64(a.max_msg_sz),
		LID:        uint16(a.lid),
		SMLID:      uint16(a.sm_lid),
		LinkLayer:  int(a.link_layer),
	}, nil
}

// QueryGID reads one GID table entry with its type (ibv_query_gid_ex).
// Where that verb is not supported, it reads the GID with ibv_query_gid and
// leaves the type GIDTypeUnknown for the caller to find in sysfs. Unused
// entries fail with ENODATA (or come back all zeros from the old verb).
func (c *Context) QueryGID(port, index int) (GIDEntry, error) {
	ctx, err := c.live("ibv_query_gid_ex")
	if err != nil {
		return GIDEntry{}, err
	}
	e := GIDEntry{Index: index, Port: port, Type: GIDTypeUnknown}
	var typ C.int
	c.cnt.control.Add(1)
	rc := C.gdr_query_gid_ex(ctx, C.int(port), C.int(index), (*C.uint8_t)(unsafe.Pointer(&e.GID[0])), &typ)
	if rc == 0 {
		// enum ibv_gid_type: IB, RoCE v1, RoCE v2, as GIDType.
		if typ >= 0 && typ <= 2 {
			e.Type = GIDType(typ)
		}
		return e, nil
	}
	if errnoOf(rc) != syscall.EOPNOTSUPP && errnoOf(rc) != syscall.ENOSYS {
		return e, c.errf("ibv_query_gid_ex", errnoOf(rc), "port %d index %d", port, index)
	}
	c.cnt.control.Add(1)
	if rc := C.gdr_query_gid(ctx, C.int(port), C.int(index), (*C.uint8_t)(unsafe.Pointer(&e.GID[0]))); rc != 0 {
		return e, c.errf("ibv_query_gid", errnoOf(rc), "port %d index %d", port, index)
	}
	return e, nil
}

// gidEntryC mirrors struct ibv_gid_entry.
type gidEntryC struct {
	GID     GID
	Index   uint32
	Port    uint32
	Type    uint32
	Ifindex uint32
}

// GIDTable reads every valid GID entry of every port in one call
// (ibv_query_gid_table); max is the total size of the ports' tables. Where
// the verb is not supported it fails with EOPNOTSUPP, and callers read
// entries one by one with QueryGID.
func (c *Context) GIDTable(max int) ([]GIDEntry, error) {
	ctx, err := c.live("ibv_query_gid_table")
	if err != nil {
		return nil, err
	}
	if max <= 0 {
		return nil, nil
	}
	buf := make([]gidEntryC, max)
	c.cnt.control.Add(1)
	n := C.gdr_query_gid_table(ctx, (*C.struct_ibv_gid_entry)(unsafe.Pointer(&buf[0])), C.size_t(max))
	if n < 0 {
		return nil, c.errf("ibv_query_gid_table", errnoOf(C.int(n)), "%d entries", max)
	}
	out := make([]GIDEntry, 0, int(n))
	for _, e := range buf[:int(n)] {
		t := GIDTypeUnknown
		if e.Type <= 2 {
			t = GIDType(e.Type)
		}
		out = append(out, GIDEntry{Index: int(e.Index), Port: int(e.Port), GID: e.GID, Type: t})
	}
	return out, nil
}

// PD is a protection domain.
type PD struct {
	c  *Context
	mu sync.Mutex
	pd *C.struct_ibv_pd
}

// AllocPD makes a protection domain.
func (c *Context) AllocPD() (*PD, error) {
	ctx, err := c.live("ibv_alloc_pd")
	if err != nil {
		return nil, err
	}
	c.cnt.control.Add(1)
	pd, cerr := C.ibv_alloc_pd(ctx)
	if pd == nil {
		return nil, c.errf("ibv_alloc_pd", lastErrno(cerr), "")
	}
	return &PD{c: c, pd: pd}, nil
}

// Close deallocates the domain. Idempotent; EBUSY while regions or queue
// pairs use it.
func (p *PD) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pd == nil {
		return nil
	}
	p.c.cnt.control.Add(1)
	if rc := C.ibv_dealloc_pd(p.pd); rc != 0 {
		return p.c.errf("ibv_dealloc_pd", errnoOf(rc), "")
	}
	p.pd = nil
	return nil
}

func (p *PD) live(op string) (*C.struct_ibv_pd, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pd == nil {
		return nil, p.c.errf(op, syscall.EBADF, "protection domain closed")
	}
	return p.pd, nil
}

// MR is a registered memory region.
type MR struct {
	c    *Context
	mu   sync.Mutex
	mr   *C.struct_ibv_mr
	addr uintptr
	n    int
	lkey uint32
	rkey uint32
}

// Addr is the region's first address (its iova for dma-buf regions).
func (m *MR) Addr() uintptr { return m.addr }

// Len is the region's length.
func (m *MR) Len() int { return m.n }

// LKey is the local key.
func (m *MR) LKey() uint32 { return m.lkey }

// RKey is the remote key.
func (m *MR) RKey() uint32 { return m.rkey }

// Close deregisters the region. Idempotent.
func (m *MR) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mr == nil {
		return nil
	}
	m.c.cnt.control.Add(1)
	if rc := C.ibv_dereg_mr(m.mr); rc != 0 {
		return m.c.errf("ibv_dereg_mr", errnoOf(rc), "%#x+%d", m.addr, m.n)
	}
	m.mr = nil
	return nil
}

// RegMR registers [addr, addr+length) of this process's memory, which must
// stay mapped (and off the Go heap) until the region is closed.
func (p *PD) RegMR(addr uintptr, length int, access int) (*MR, error) {
	pd, err := p.live("ibv_reg_mr")
	if err != nil {
		return nil, err
	}
	if length <= 0 {
		return nil, p.c.errf("ibv_reg_mr", syscall.EINVAL, "length %d", length)
	}
	p.c.cnt.control.Add(1)
	mr, cerr := C.gdr_reg_mr(pd, C.uintptr_t(addr), C.size_t(length), C.int(access))
	if mr == nil {
		return nil, p.c.errf("ibv_reg_mr", lastErrno(cerr), "%#x+%d access %#x", addr, length, access)
	}
	return &MR{c: p.c, mr: mr, addr: addr, n: length, lkey: uint32(mr.lkey), rkey: uint32(mr.rkey)}, nil
}

// RegDMABufMR registers length bytes at offset of the dma-buf fd, addressed
// as iova in work requests. Devices without dma-buf support fail with
// EOPNOTSUPP.
func (p *PD) RegDMABufMR(offset uint64, length int, iova uint64, fd int, access int) (*MR, error) {
	pd, err := p.live("ibv_reg_dmabuf_mr")
	if err != nil {
		return nil, err
	}
	if length <= 0 {
		return nil, p.c.errf("ibv_reg_dmabuf_mr", syscall.EINVAL, "length %d", length)
	}
	p.c.cnt.control.Add(1)
	mr, cerr := C.gdr_reg_dmabuf_mr(pd, C.uint64_t(offset), C.size_t(length), C.uint64_t(iova), C.int(fd), C.int(access))
	if mr == nil {
		return nil, p.c.errf("ibv_reg_dmabuf_mr", lastErrno(cerr), "fd %d offset %d len %d", fd, offset, length)
	}
	return &MR{c: p.c, mr: mr, addr: uintptr(iova), n: length, lkey: uint32(mr.lkey), rkey: uint32(mr.rkey)}, nil
}

// CQ is a completion queue with its own completion channel, whose file
// descriptor is non-blocking and waits in Go's network poller.
type CQ struct {
	c *Context

	// mu guards the C objects: users hold it shared, Close exclusively.
	mu   sync.RWMutex
	cq   *C.struct_ibv_cq
	ch   *C.struct_ibv_comp_channel
	file *os.File // a dup of the channel's fd, registered with the poller
	raw  syscall.RawConn
	cqe  int
	// waitSem admits one waiter at a time on the channel.
	waitSem chan struct{}
}

// CreateCQ makes a completion queue of at least depth entries with a
// completion channel.
func (c *Context) CreateCQ(depth int) (*CQ, error) {
	ctx, err := c.live("ibv_create_cq")
	if err != nil {
		return nil, err
	}
	c.cnt.control.Add(1)
	ch, cerr := C.ibv_create_comp_channel(ctx)
	if ch == nil {
		return nil, c.errf("ibv_create_comp_channel", lastErrno(cerr), "")
	}
	destroyCh := func() { c.cnt.control.Add(1); C.ibv_destroy_comp_channel(ch) }
	fd := int(ch.fd)
	if err := unix.SetNonblock(fd, true); err != nil {
		destroyCh()
		return nil, c.errf("fcntl(O_NONBLOCK)", lastErrno(err), "completion channel fd %d", fd)
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		destroyCh()
		return nil, c.errf("fcntl(F_DUPFD)", lastErrno(err), "completion channel fd %d", fd)
	}
	f := os.NewFile(uintptr(dup), fmt.Sprintf("ibv-comp-channel-%s", c.name))
	raw, err := f.SyscallConn()
	if err != nil {
		f.Close()
		destroyCh()
		return nil, c.errf("completion channel", syscall.EIO, "%v", err)
	}
	c.cnt.control.Add(1)
	cq, cerr := C.ibv_create_cq(ctx, C.int(depth), nil, ch, 0)
	if cq == nil {
		f.Close()
		destroyCh()
		return nil, c.errf("ibv_create_cq", lastErrno(cerr), "depth %d", depth)
	}
	return &CQ{c: c, cq: cq, ch: ch, file: f, raw: raw, cqe: int(cq.cqe), waitSem: make(chan struct{}, 1)}, nil
}

// Depth is the number of entries the queue holds.
func (q *CQ) Depth() int { return q.cqe }

// Close destroys the queue and its channel. Idempotent; EBUSY while queue
// pairs use it (the queue then stays usable).
func (q *CQ) Close() error {
	q.mu.RLock()
	closed := q.cq == nil
	q.mu.RUnlock()
	if closed {
		return nil
	}
	// Closing the poller's file wakes a waiter blocked on the channel, so
	// the exclusive lock below cannot wait on an idle wait forever.
	q.file.Close()
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.cq == nil {
		return nil
	}
	q.c.cnt.control.Add(1)
	if rc := C.ibv_destroy_cq(q.cq); rc != 0 {
		// Still in use: give the queue a fresh poller file so it stays usable.
		if dup, err := unix.FcntlInt(uintptr(q.ch.fd), unix.F_DUPFD_CLOEXEC, 0); err == nil {
			q.file = os.NewFile(uintptr(dup), q.file.Name())
			q.raw, _ = q.file.SyscallConn()
		}
		return q.c.errf("ibv_destroy_cq", errnoOf(rc), "")
	}
	q.c.cnt.control.Add(1)
	C.ibv_destroy_comp_channel(q.ch)
	q.cq, q.ch = nil, nil
	return nil
}

// Poll moves up to len(out) completions into out in one cgo call.
func (q *CQ) Poll(out []WC) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	q.mu.RLock()
	defer q.mu.RUnlock()
	if q.cq == nil {
		return 0, q.c.errf("ibv_poll_cq", syscall.EBADF, "completion queue closed")
	}
	q.c.cnt.poll.Add(1)
	n := C.gdr_poll_cq(q.cq, (*C.gdr_wc)(unsafe.Pointer(&out[0])), C.int(len(out)))
	if n < 0 {
		return 0, q.c.errf("ibv_poll_cq", errnoOf(n), "")
	}
	q.c.cnt.completions.Add(uint64(n))
	return int(n), nil
}

// Arm asks for a completion event on the channel at the next completion
// (ibv_req_notify_cq).
func (q *CQ) Arm() error {
	q.mu.RLock()
	defer q.mu.RUnlock()
	if q.cq == nil {
		return q.c.errf("ibv_req_notify_cq", syscall.EBADF, "completion queue closed")
	}
	q.c.cnt.notify.Add(1)
	if rc := C.gdr_req_notify(q.cq); rc != 0 {
		return q.c.errf("ibv_req_notify_cq", errnoOf(rc), "")
	}
	return nil
}

// WaitEvent blocks, in Go's poller and without burning CPU, until the
// channel delivers an event for this queue (after Arm) or ctx ends, then
// acknowledges it. It returns ctx.Err() when ctx ends first.
func (q *CQ) WaitEvent(ctx context.Context) error {
	select {
	case q.waitSem <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-q.waitSem }()
	q.mu.RLock()
	defer q.mu.RUnlock()
	if q.cq == nil {
		return q.c.errf("ibv_get_cq_event", syscall.EBADF, "completion queue closed")
	}
	dl, _ := ctx.Deadline()
	if err := q.file.SetReadDeadline(dl); err != nil {
		return q.c.errf("ibv_get_cq_event", syscall.EIO, "%v", err)
	}
	stop := context.AfterFunc(ctx, func() { q.file.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	var rc C.int
	err := q.raw.Read(func(uintptr) bool {
		var got *C.struct_ibv_cq
		q.c.cnt.notify.Add(1)
		rc = C.gdr_get_cq_event(q.ch, &got)
		if rc == C.EAGAIN || rc == C.EWOULDBLOCK {
			return false
		}
		if rc == 0 {
			q.c.cnt.notify.Add(1)
			C.ibv_ack_cq_events(got, 1)
		}
		return true
	})
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return context.DeadlineExceeded
		}
		return q.c.errf("ibv_get_cq_event", syscall.EBADF, "%v", err)
	}
	if rc != 0 {
		return q.c.errf("ibv_get_cq_event", errnoOf(rc), "")
	}
	return nil
}

// QP is a reliable-connected queue pair.
type QP struct {
	c    *Context
	mu   sync.RWMutex
	qp   *C.struct_ibv_qp
	qpn  uint32
	caps QPCaps
}

// CreateQP makes a reliable-connected queue pair in RESET state. The
// granted sizes are in Caps.
func (p *PD) CreateQP(send, recv *CQ, want QPCaps) (*QP, error) {
	pd, err := p.live("ibv_create_qp")
	if err != nil {
		return nil, err
	}
	send.mu.RLock()
	defer send.mu.RUnlock()
	if send != recv {
		recv.mu.RLock()
		defer recv.mu.RUnlock()
	}
	if send.cq == nil || recv.cq == nil {
		return nil, p.c.errf("ibv_create_qp", syscall.EBADF, "completion queue closed")
	}
	var caps [5]C.int
	p.c.cnt.control.Add(1)
	qp, cerr := C.gdr_create_qp(pd, send.cq, recv.cq, C.int(want.MaxSendWR), C.int(want.MaxRecvWR),
		C.int(want.MaxSendSGE), C.int(want.MaxRecvSGE), C.int(want.MaxInline), &caps[0])
	if qp == nil {
		return nil, p.c.errf("ibv_create_qp", lastErrno(cerr), "%+v", want)
	}
	return &QP{c: p.c, qp: qp, qpn: uint32(qp.qp_num), caps: QPCaps{
		MaxSendWR: int(caps[0]), MaxRecvWR: int(caps[1]), MaxSendSGE: int(caps[2]), MaxRecvSGE: int(caps[3]), MaxInline: int(caps[4]),
	}}, nil
}

// QPN is the queue pair number.
func (q *QP) QPN() uint32 { return q.qpn }

// Caps are the sizes the device granted.
func (q *QP) Caps() QPCaps { return q.caps }

func (q *QP) live(op string) (*C.struct_ibv_qp, func(), error) {
	q.mu.RLock()
	if q.qp == nil {
		q.mu.RUnlock()
		return nil, nil, q.c.errf(op, syscall.EBADF, "queue pair %d closed", q.qpn)
	}
	return q.qp, q.mu.RUnlock, nil
}

// Close destroys the queue pair. Idempotent.
func (q *QP) Close() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.qp == nil {
		return nil
	}
	q.c.cnt.control.Add(1)
	if rc := C.ibv_destroy_qp(q.qp); rc != 0 {
		return q.c.errf("ibv_destroy_qp", errnoOf(rc), "qp %d", q.qpn)
	}
	q.qp = nil
	return nil
}

// ToInit moves the queue pair from RESET to INIT.
func (q *QP) ToInit(port, pkeyIndex, access int) error {
	qp, unlock, err := q.live("ibv_modify_qp(INIT)")
	if err != nil {
		return err
	}
	defer unlock()
	q.c.cnt.control.Add(1)
	if rc := C.gdr_qp_init(qp, C.int(port), C.int(pkeyIndex), C.int(access)); rc != 0 {
		return q.c.errf("ibv_modify_qp(INIT)", errnoOf(rc), "qp %d port %d pkey index %d", q.qpn, port, pkeyIndex)
	}
	return nil
}

// ToRTR moves the queue pair from INIT to RTR.
func (q *QP) ToRTR(a RTRAttr) error {
	qp, unlock, err := q.live("ibv_modify_qp(RTR)")
	if err != nil {
		return err
	}
	defer unlock()
	mtu := MTUEnum(a.MTU)
	if mtu == 0 {
		return q.c.errf("ibv_modify_qp(RTR)", syscall.EINVAL, "mtu %d", a.MTU)
	}
	global := C.int(0)
	if a.Global {
		global = 1
	}
	dgid := a.DGID
	q.c.cnt.control.Add(1)
	rc := C.gdr_qp_rtr(qp, C.uint32_t(a.DestQPN), C.uint32_t(a.RQPSN), C.int(mtu), global,
		(*C.uint8_t)(unsafe.Pointer(&dgid[0])), C.int(a.SGIDIndex), C.int(a.HopLimit), C.int(a.TClass),
		C.int(a.DLID), C.int(a.SL), C.int(a.Port), C.int(a.MaxDestRdAtomic), C.int(a.MinRNRTimer))
	if rc != 0 {
		return q.c.errf("ibv_modify_qp(RTR)", errnoOf(rc), "qp %d -> qp %d gid %s mtu %d", q.qpn, a.DestQPN, a.DGID, a.MTU)
	}
	return nil
}

// ToRTS moves the queue pair from RTR to RTS.
func (q *QP) ToRTS(a RTSAttr) error {
	qp, unlock, err := q.live("ibv_modify_qp(RTS)")
	if err != nil {
		return err
	}
	defer unlock()
	q.c.cnt.control.Add(1)
	if rc := C.gdr_qp_rts(qp, C.uint32_t(a.SQPSN), C.int(a.Timeout), C.int(a.RetryCount), C.int(a.RNRRetry), C.int(a.MaxRdAtomic)); rc != 0 {
		return q.c.errf("ibv_modify_qp(RTS)", errnoOf(rc), "qp %d", q.qpn)
	}
	return nil
}

// ToError moves the queue pair to ERROR: outstanding work requests complete
// as flushed.
func (q *QP) ToError() error {
	qp, unlock, err := q.live("ibv_modify_qp(ERR)")
	if err != nil {
		return err
	}
	defer unlock()
	q.c.cnt.control.Add(1)
	if rc := C.gdr_qp_err(qp); rc != 0 {
		return q.c.errf("ibv_modify_qp(ERR)", errnoOf(rc), "qp %d", q.qpn)
	}
	return nil
}

// State queries the queue pair's state (QPS*).
func (q *QP) State() (int, error) {
	qp, unlock, err := q.live("ibv_query_qp")
	if err != nil {
		return 0, err
	}
	defer unlock()
	var s C.int
	q.c.cnt.control.Add(1)
	if rc := C.gdr_qp_state(qp, &s); rc != 0 {
		return 0, q.c.errf("ibv_query_qp", errnoOf(rc), "qp %d", q.qpn)
	}
	return int(s), nil
}

// PostSend posts a chain of work requests in one cgo call. On failure it
// returns how many were posted before the one that failed, and the error.
func (q *QP) PostSend(wrs []SendWR, sges []SGE) (int, error) {
	if len(wrs) == 0 {
		return 0, nil
	}
	qp, unlock, err := q.live("ibv_post_send")
	if err != nil {
		return 0, err
	}
	defer unlock()
	if err := checkSGEs(len(sges), func(i int) (uint32, uint32) { return wrs[i].SGEOff, wrs[i].NumSGE }, len(wrs)); err != nil {
		return 0, q.c.errf("ibv_post_send", syscall.EINVAL, "%v", err)
	}
	var sp *C.struct_ibv_sge
	if len(sges) > 0 {
		sp = (*C.struct_ibv_sge)(unsafe.Pointer(&sges[0]))
	}
	var bad C.int
	q.c.cnt.postSend.Add(1)
	rc := C.gdr_post_send(qp, (*C.gdr_send_wr)(unsafe.Pointer(&wrs[0])), C.int(len(wrs)), sp, &bad)
	q.c.cnt.sendWRs.Add(uint64(bad))
	if rc != 0 {
		return int(bad), q.c.errf("ibv_post_send", errnoOf(rc), "qp %d, %d of %d posted", q.qpn, int(bad), len(wrs))
	}
	return len(wrs), nil
}

// PostRecv posts a chain of receive work requests in one cgo call.
func (q *QP) PostRecv(wrs []RecvWR, sges []SGE) (int, error) {
	if len(wrs) == 0 {
		return 0, nil
	}
	qp, unlock, err := q.live("ibv_post_recv")
	if err != nil {
		return 0, err
	}
	defer unlock()
	if err := checkSGEs(len(sges), func(i int) (uint32, uint32) { return wrs[i].SGEOff, wrs[i].NumSGE }, len(wrs)); err != nil {
		return 0, q.c.errf("ibv_post_recv", syscall.EINVAL, "%v", err)
	}
	var sp *C.struct_ibv_sge
	if len(sges) > 0 {
		sp = (*C.struct_ibv_sge)(unsafe.Pointer(&sges[0]))
	}
	var bad C.int
	q.c.cnt.postRecv.Add(1)
	rc := C.gdr_post_recv(qp, (*C.gdr_recv_wr)(unsafe.Pointer(&wrs[0])), C.int(len(wrs)), sp, &bad)
	q.c.cnt.recvWRs.Add(uint64(bad))
	if rc != 0 {
		return int(bad), q.c.errf("ibv_post_recv", errnoOf(rc), "qp %d, %d of %d posted", q.qpn, int(bad), len(wrs))
	}
	return len(wrs), nil
}

// Compile-time checks that the Go mirrors match the C layouts.
var (
	_ [unsafe.Sizeof(SendWR{}) - unsafe.Sizeof(C.gdr_send_wr{})]struct{}
	_ [unsafe.Sizeof(C.gdr_send_wr{}) - unsafe.Sizeof(SendWR{})]struct{}
	_ [unsafe.Sizeof(RecvWR{}) - unsafe.Sizeof(C.gdr_recv_wr{})]struct{}
	_ [unsafe.Sizeof(C.gdr_recv_wr{}) - unsafe.Sizeof(RecvWR{})]struct{}
	_ [unsafe.Sizeof(WC{}) - unsafe.Sizeof(C.gdr_wc{})]struct{}
	_ [unsafe.Sizeof(C.gdr_wc{}) - unsafe.Sizeof(WC{})]struct{}
	_ [unsafe.Sizeof(SGE{}) - unsafe.Sizeof(C.struct_ibv_sge{})]struct{}
	_ [unsafe.Sizeof(gidEntryC{}) - unsafe.Sizeof(C.struct_ibv_gid_entry{})]struct{}
	_ [unsafe.Sizeof(C.struct_ibv_gid_entry{}) - unsafe.Sizeof(gidEntryC{})]struct{}
	_ [unsafe.Sizeof(C.struct_ibv_sge{}) - unsafe.Sizeof(SGE{})]struct{}
)
