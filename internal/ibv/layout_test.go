package ibv

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unsafe"
)

// layoutFacts pairs each C expression of the layout the package relies on
// with the value the package declares.
func layoutFacts() []struct {
	c   string
	go_ uintptr
} {
	var (
		sw  cSendWR
		rw  cRecvWR
		wc  cWC
		ia  cQPInitAttr
		qa  cQPAttr
		ah  cAHAttr
		grh cGlobalRoute
		cap cQPCap
		ge  gidEntryC
	)
	return []struct {
		c   string
		go_ uintptr
	}{
		{"offsetof(struct ibv_context, ops)", offContextOps},
		{"offsetof(struct ibv_context_ops, poll_cq)", offOpsPollCQ},
		{"offsetof(struct ibv_context_ops, req_notify_cq)", offOpsReqNotifyCQ},
		{"offsetof(struct ibv_context_ops, post_send)", offOpsPostSend},
		{"offsetof(struct ibv_context_ops, post_recv)", offOpsPostRecv},
		{"offsetof(struct ibv_context_ops, alloc_mw)", offOpsAllocMW},
		{"offsetof(struct ibv_context_ops, dealloc_mw)", offOpsDeallocMW},
		{"offsetof(struct ibv_device, transport_type)", offDeviceTransport},
		{"sizeof(struct ibv_device_attr)", sizeDeviceAttr},
		{"offsetof(struct ibv_device_attr, node_guid)", offDevAttrNodeGUID},
		{"offsetof(struct ibv_device_attr, max_mr_size)", offDevAttrMaxMRSize},
		{"offsetof(struct ibv_device_attr, vendor_id)", offDevAttrVendorID},
		{"offsetof(struct ibv_device_attr, vendor_part_id)", offDevAttrVendorPartID},
		{"offsetof(struct ibv_device_attr, max_qp)", offDevAttrMaxQP},
		{"offsetof(struct ibv_device_attr, max_qp_wr)", offDevAttrMaxQPWR},
		{"offsetof(struct ibv_device_attr, max_sge)", offDevAttrMaxSGE},
		{"offsetof(struct ibv_device_attr, max_cq)", offDevAttrMaxCQ},
		{"offsetof(struct ibv_device_attr, max_cqe)", offDevAttrMaxCQE},
		{"offsetof(struct ibv_device_attr, max_mr)", offDevAttrMaxMR},
		{"offsetof(struct ibv_device_attr, max_pd)", offDevAttrMaxPD},
		{"offsetof(struct ibv_device_attr, max_qp_rd_atom)", offDevAttrMaxQPRdAtom},
		{"offsetof(struct ibv_device_attr, max_qp_init_rd_atom)", offDevAttrMaxQPInitRdAtom},
		{"offsetof(struct ibv_device_attr, phys_port_cnt)", offDevAttrPhysPortCnt},
		{"offsetof(struct ibv_device_attr, device_cap_flags)", offDevAttrDeviceCapFlags},
		{"offsetof(struct ibv_device_attr, max_mw)", offDevAttrMaxMW},
		{"IBV_DEVICE_MEM_WINDOW", DeviceMemWindow},
		{"IBV_DEVICE_MEM_WINDOW_TYPE_2A", DeviceMemWindowType2A},
		{"IBV_DEVICE_MEM_WINDOW_TYPE_2B", DeviceMemWindowType2B},
		{"offsetof(struct ibv_mw, rkey)", offMWRKey},
		{"IBV_MW_TYPE_2", mwType2},
		{"offsetof(struct ibv_port_attr, state)", offPortState},
		{"offsetof(struct ibv_port_attr, max_mtu)", offPortMaxMTU},
		{"offsetof(struct ibv_port_attr, active_mtu)", offPortActiveMTU},
		{"offsetof(struct ibv_port_attr, gid_tbl_len)", offPortGIDTblLen},
		{"offsetof(struct ibv_port_attr, max_msg_sz)", offPortMaxMsgSz},
		{"offsetof(struct ibv_port_attr, pkey_tbl_len)", offPortPKeyTblLen},
		{"offsetof(struct ibv_port_attr, lid)", offPortLID},
		{"offsetof(struct ibv_port_attr, sm_lid)", offPortSMLID},
		{"offsetof(struct ibv_port_attr, link_layer)", offPortLinkLayer},
		{"(sizeof(struct ibv_port_attr) <= 256 ? 1 : 0)", 1}, // portAttrBuf holds it
		{"offsetof(struct ibv_mr, lkey)", offMRLKey},
		{"offsetof(struct ibv_mr, rkey)", offMRRKey},
		{"offsetof(struct ibv_cq, cqe)", offCQCQE},
		{"offsetof(struct ibv_comp_channel, fd)", offCompChannelFD},
		{"offsetof(struct ibv_qp, qp_num)", offQPNum},
		{"IBV_QPT_RC", qpTypeRC},
		{"IBV_QPT_UC", qpTypeUC},
		{"IBV_QP_STATE", maskState},
		{"IBV_QP_ACCESS_FLAGS", maskAccessFlags},
		{"IBV_QP_PKEY_INDEX", maskPKeyIndex},
		{"IBV_QP_PORT", maskPort},
		{"IBV_QP_AV", maskAV},
		{"IBV_QP_PATH_MTU", maskPathMTU},
		{"IBV_QP_TIMEOUT", maskTimeout},
		{"IBV_QP_RETRY_CNT", maskRetryCnt},
		{"IBV_QP_RNR_RETRY", maskRNRRetry},
		{"IBV_QP_RQ_PSN", maskRQPSN},
		{"IBV_QP_MAX_QP_RD_ATOMIC", maskMaxQPRdAtomic},
		{"IBV_QP_MIN_RNR_TIMER", maskMinRNRTimer},
		{"IBV_QP_SQ_PSN", maskSQPSN},
		{"IBV_QP_MAX_DEST_RD_ATOMIC", maskMaxDestRdAtomic},
		{"IBV_QP_DEST_QPN", maskDestQPN},
		{"IBV_WR_RDMA_WRITE", WRWrite},
		{"IBV_WR_RDMA_WRITE_WITH_IMM", WRWriteImm},
		{"IBV_WR_SEND", WRSend},
		{"IBV_WR_SEND_WITH_IMM", WRSendImm},
		{"IBV_WR_RDMA_READ", WRRead},
		{"IBV_WR_LOCAL_INV", WRLocalInv},
		{"IBV_WR_BIND_MW", WRBindMW},
		{"IBV_WC_BIND_MW", WCBindMW},
		{"IBV_WC_LOCAL_INV", WCLocalInv},
		{"IBV_SEND_SIGNALED", SendSignaled},
		{"IBV_SEND_INLINE", SendInline},
		{"IBV_WC_RECV_RDMA_WITH_IMM", WCRecvRDMAImm},
		{"IBV_WC_WITH_IMM", WCWithImm},
		{"IBV_ACCESS_REMOTE_WRITE", AccessRemoteWrite},
		{"IBV_ACCESS_REMOTE_READ", AccessRemoteRead},
		{"IBV_ACCESS_LOCAL_WRITE", AccessLocalWrite},
		{"IBV_ACCESS_MW_BIND", AccessMWBind},
		{"sizeof(struct ibv_send_wr)", unsafe.Sizeof(sw)},
		{"offsetof(struct ibv_send_wr, next)", unsafe.Offsetof(sw.next)},
		{"offsetof(struct ibv_send_wr, sg_list)", unsafe.Offsetof(sw.sgList)},
		{"offsetof(struct ibv_send_wr, num_sge)", unsafe.Offsetof(sw.numSGE)},
		{"offsetof(struct ibv_send_wr, opcode)", unsafe.Offsetof(sw.opcode)},
		{"offsetof(struct ibv_send_wr, send_flags)", unsafe.Offsetof(sw.sendFlags)},
		{"offsetof(struct ibv_send_wr, imm_data)", unsafe.Offsetof(sw.immData)},
		{"offsetof(struct ibv_send_wr, wr.rdma.remote_addr)", unsafe.Offsetof(sw.remoteAddr)},
		{"offsetof(struct ibv_send_wr, wr.rdma.rkey)", unsafe.Offsetof(sw.rkey)},
		{"offsetof(struct ibv_send_wr, invalidate_rkey)", unsafe.Offsetof(sw.immData)},
		{"offsetof(struct ibv_send_wr, bind_mw.mw)", unsafe.Offsetof(sw.bindMW)},
		{"offsetof(struct ibv_send_wr, bind_mw.rkey)", unsafe.Offsetof(sw.bindRKey)},
		{"offsetof(struct ibv_send_wr, bind_mw.bind_info.mr)", unsafe.Offsetof(sw.bindMR)},
		{"offsetof(struct ibv_send_wr, bind_mw.bind_info.addr)", unsafe.Offsetof(sw.bindAddr)},
		{"offsetof(struct ibv_send_wr, bind_mw.bind_info.length)", unsafe.Offsetof(sw.bindLength)},
		{"offsetof(struct ibv_send_wr, bind_mw.bind_info.mw_access_flags)", unsafe.Offsetof(sw.bindAccess)},
		{"sizeof(struct ibv_recv_wr)", unsafe.Sizeof(rw)},
		{"offsetof(struct ibv_recv_wr, next)", unsafe.Offsetof(rw.next)},
		{"offsetof(struct ibv_recv_wr, sg_list)", unsafe.Offsetof(rw.sgList)},
		{"offsetof(struct ibv_recv_wr, num_sge)", unsafe.Offsetof(rw.numSGE)},
		{"sizeof(struct ibv_sge)", unsafe.Sizeof(SGE{})},
		{"offsetof(struct ibv_sge, lkey)", unsafe.Offsetof(SGE{}.LKey)},
		{"sizeof(struct ibv_wc)", unsafe.Sizeof(wc)},
		{"offsetof(struct ibv_wc, status)", unsafe.Offsetof(wc.status)},
		{"offsetof(struct ibv_wc, opcode)", unsafe.Offsetof(wc.opcode)},
		{"offsetof(struct ibv_wc, vendor_err)", unsafe.Offsetof(wc.vendorErr)},
		{"offsetof(struct ibv_wc, byte_len)", unsafe.Offsetof(wc.byteLen)},
		{"offsetof(struct ibv_wc, imm_data)", unsafe.Offsetof(wc.immData)},
		{"offsetof(struct ibv_wc, qp_num)", unsafe.Offsetof(wc.qpNum)},
		{"offsetof(struct ibv_wc, wc_flags)", unsafe.Offsetof(wc.wcFlags)},
		{"sizeof(struct ibv_qp_cap)", unsafe.Sizeof(cap)},
		{"offsetof(struct ibv_qp_cap, max_inline_data)", unsafe.Offsetof(cap.maxInlineData)},
		{"sizeof(struct ibv_qp_init_attr)", unsafe.Sizeof(ia)},
		{"offsetof(struct ibv_qp_init_attr, send_cq)", unsafe.Offsetof(ia.sendCQ)},
		{"offsetof(struct ibv_qp_init_attr, recv_cq)", unsafe.Offsetof(ia.recvCQ)},
		{"offsetof(struct ibv_qp_init_attr, cap)", unsafe.Offsetof(ia.cap)},
		{"offsetof(struct ibv_qp_init_attr, qp_type)", unsafe.Offsetof(ia.qpType)},
		{"offsetof(struct ibv_qp_init_attr, sq_sig_all)", unsafe.Offsetof(ia.sqSigAll)},
		{"sizeof(struct ibv_global_route)", unsafe.Sizeof(grh)},
		{"offsetof(struct ibv_global_route, sgid_index)", unsafe.Offsetof(grh.sgidIndex)},
		{"offsetof(struct ibv_global_route, hop_limit)", unsafe.Offsetof(grh.hopLimit)},
		{"offsetof(struct ibv_global_route, traffic_class)", unsafe.Offsetof(grh.trafficClass)},
		{"sizeof(struct ibv_ah_attr)", unsafe.Sizeof(ah)},
		{"offsetof(struct ibv_ah_attr, dlid)", unsafe.Offsetof(ah.dlid)},
		{"offsetof(struct ibv_ah_attr, sl)", unsafe.Offsetof(ah.sl)},
		{"offsetof(struct ibv_ah_attr, is_global)", unsafe.Offsetof(ah.isGlobal)},
		{"offsetof(struct ibv_ah_attr, port_num)", unsafe.Offsetof(ah.portNum)},
		{"sizeof(struct ibv_qp_attr)", unsafe.Sizeof(qa)},
		{"offsetof(struct ibv_qp_attr, path_mtu)", unsafe.Offsetof(qa.pathMTU)},
		{"offsetof(struct ibv_qp_attr, rq_psn)", unsafe.Offsetof(qa.rqPSN)},
		{"offsetof(struct ibv_qp_attr, sq_psn)", unsafe.Offsetof(qa.sqPSN)},
		{"offsetof(struct ibv_qp_attr, dest_qp_num)", unsafe.Offsetof(qa.destQPNum)},
		{"offsetof(struct ibv_qp_attr, qp_access_flags)", unsafe.Offsetof(qa.qpAccessFlags)},
		{"offsetof(struct ibv_qp_attr, ah_attr)", unsafe.Offsetof(qa.ahAttr)},
		{"offsetof(struct ibv_qp_attr, pkey_index)", unsafe.Offsetof(qa.pkeyIndex)},
		{"offsetof(struct ibv_qp_attr, max_rd_atomic)", unsafe.Offsetof(qa.maxRdAtomic)},
		{"offsetof(struct ibv_qp_attr, max_dest_rd_atomic)", unsafe.Offsetof(qa.maxDestRdAtomic)},
		{"offsetof(struct ibv_qp_attr, min_rnr_timer)", unsafe.Offsetof(qa.minRNRTimer)},
		{"offsetof(struct ibv_qp_attr, port_num)", unsafe.Offsetof(qa.portNum)},
		{"offsetof(struct ibv_qp_attr, timeout)", unsafe.Offsetof(qa.timeout)},
		{"offsetof(struct ibv_qp_attr, retry_cnt)", unsafe.Offsetof(qa.retryCnt)},
		{"offsetof(struct ibv_qp_attr, rnr_retry)", unsafe.Offsetof(qa.rnrRetry)},
		{"offsetof(struct ibv_qp_attr, rate_limit)", unsafe.Offsetof(qa.rateLimit)},
		{"sizeof(struct ibv_gid_entry)", unsafe.Sizeof(ge)},
		{"sizeof(struct ibv_gid_entry)", sizeGIDEntry},
		{"offsetof(struct ibv_gid_entry, gid_index)", unsafe.Offsetof(ge.Index)},
		{"offsetof(struct ibv_gid_entry, gid_type)", unsafe.Offsetof(ge.Type)},
	}
}

// TestLayout compiles a C program against the installed <infiniband/verbs.h>
// that prints every offset, size and constant the package declares, and
// compares. It skips, saying what is missing, where there is no C compiler
// or no rdma-core headers (neither is needed to build or run the package).
func TestLayout(t *testing.T) {
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("skipping: no C compiler (%s) to read the real layout: %v", cc, err)
	}
	facts := layoutFacts()
	var src bytes.Buffer
	src.WriteString("#include <infiniband/verbs.h>\n#include <stddef.h>\n#include <stdio.h>\nint main(void) {\n")
	for i, f := range facts {
		fmt.Fprintf(&src, "\tprintf(\"%d %%lu\\n\", (unsigned long)(%s));\n", i, f.c)
	}
	src.WriteString("\treturn 0;\n}\n")
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "layout.c"), src.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	probe := exec.Command(cc, "-E", "-x", "c", "-")
	probe.Stdin = strings.NewReader("#include <infiniband/verbs.h>\n")
	if out, err := probe.CombinedOutput(); err != nil {
		t.Skipf("skipping: no rdma-core headers (Debian's libibverbs-dev) to read the real layout: %v: %s", err, firstLine(out))
	}
	bin := filepath.Join(dir, "layout")
	if out, err := exec.Command(cc, "-o", bin, filepath.Join(dir, "layout.c")).CombinedOutput(); err != nil {
		t.Fatalf("compiling the layout program: %v\n%s", err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatalf("running the layout program: %v", err)
	}
	seen := 0
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		var i int
		var v uint64
		if _, err := fmt.Sscanf(sc.Text(), "%d %d", &i, &v); err != nil || i < 0 || i >= len(facts) {
			t.Fatalf("layout program printed %q", sc.Text())
		}
		seen++
		if uint64(facts[i].go_) != v {
			t.Errorf("%s: the package declares %d, the headers say %d", facts[i].c, facts[i].go_, v)
		}
	}
	if seen != len(facts) {
		t.Fatalf("layout program printed %d of %d facts", seen, len(facts))
	}
	t.Logf("%d offsets, sizes and constants match the installed headers", seen)
}

func firstLine(b []byte) string {
	s, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
	return strconv.Quote(s)
}
