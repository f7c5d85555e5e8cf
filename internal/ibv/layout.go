package ibv

// The structures of rdma-core's <infiniband/verbs.h> the package reads or
// fills, declared once here with their layout on 64-bit Linux. The layout is
// part of libibverbs' ABI (stable since libibverbs 1.1; newer releases only
// append fields), and TestLayout checks every offset and size below against
// the installed headers with the C compiler, where both are present.

// Offsets into struct ibv_context and its ops table (struct
// ibv_context_ops): the data-path verbs are inline functions of verbs.h that
// call through these pointers, so the package calls them the same way.
const (
	offContextOps      = 8
	offOpsPollCQ       = 88
	offOpsReqNotifyCQ  = 96
	offOpsPostSend     = 200
	offOpsPostRecv     = 208
	offOpsAllocMW      = 56 // inline ibv_alloc_mw calls it
	offOpsDeallocMW    = 72 // inline ibv_dealloc_mw calls it
	offDeviceTransport = 20 // struct ibv_device.transport_type
)

// struct ibv_device_attr: offsets of the fields DeviceAttr reads.
const (
	sizeDeviceAttr            = 232
	offDevAttrNodeGUID        = 64
	offDevAttrMaxMRSize       = 80
	offDevAttrVendorID        = 96
	offDevAttrVendorPartID    = 100
	offDevAttrMaxQP           = 108
	offDevAttrMaxQPWR         = 112
	offDevAttrDeviceCapFlags  = 116
	offDevAttrMaxSGE          = 120
	offDevAttrMaxCQ           = 128
	offDevAttrMaxCQE          = 132
	offDevAttrMaxMR           = 136
	offDevAttrMaxPD           = 140
	offDevAttrMaxQPRdAtom     = 144
	offDevAttrMaxQPInitRdAtom = 156
	offDevAttrMaxMW           = 176
	offDevAttrPhysPortCnt     = 227
)

// struct ibv_port_attr: offsets of the fields PortAttr reads. Releases
// append fields (active_speed_ex in rdma-core 47), so the package hands
// ibv_query_port a buffer of portAttrBuf bytes, larger than any of them.
const (
	sizePortAttr      = 52
	portAttrBuf       = 256
	offPortState      = 0
	offPortMaxMTU     = 4
	offPortActiveMTU  = 8
	offPortGIDTblLen  = 12
	offPortMaxMsgSz   = 20
	offPortPKeyTblLen = 32
	offPortLID        = 34
	offPortSMLID      = 36
	offPortLinkLayer  = 46
	offMRLKey         = 36 // struct ibv_mr.lkey
	offMRRKey         = 40 // struct ibv_mr.rkey
	offCQCQE          = 28 // struct ibv_cq.cqe
	offCompChannelFD  = 8  // struct ibv_comp_channel.fd
	offQPNum          = 52 // struct ibv_qp.qp_num
	offMWRKey         = 16 // struct ibv_mw.rkey
	mwType2           = 2  // IBV_MW_TYPE_2
	sizeGIDEntry      = 32 // struct ibv_gid_entry
	qpTypeRC          = 2  // IBV_QPT_RC
	qpTypeUC          = 3  // IBV_QPT_UC
)

// Attribute masks of ibv_modify_qp, as enum ibv_qp_attr_mask.
const (
	maskState           = 1 << 0
	maskAccessFlags     = 1 << 3
	maskPKeyIndex       = 1 << 4
	maskPort            = 1 << 5
	maskAV              = 1 << 7
	maskPathMTU         = 1 << 8
	maskTimeout         = 1 << 9
	maskRetryCnt        = 1 << 10
	maskRNRRetry        = 1 << 11
	maskRQPSN           = 1 << 12
	maskMaxQPRdAtomic   = 1 << 13
	maskMinRNRTimer     = 1 << 15
	maskSQPSN           = 1 << 16
	maskMaxDestRdAtomic = 1 << 17
	maskDestQPN         = 1 << 20
)

// cSendWR is struct ibv_send_wr with the RDMA member of its wr union and
// the bind_mw member of its last union (a type 2 window's bind).
type cSendWR struct {
	wrID       uint64
	next       uintptr
	sgList     uintptr
	numSGE     int32
	opcode     uint32
	sendFlags  uint32
	immData    uint32 // network byte order; invalidate_rkey (host order) of IBV_WR_LOCAL_INV
	remoteAddr uint64
	rkey       uint32
	_          [28]byte // rest of the wr union (atomic is the largest), qp_type, padding
	bindMW     uintptr  // bind_mw.mw
	bindRKey   uint32   // bind_mw.rkey: the window's new rkey
	_          uint32
	bindMR     uintptr // bind_mw.bind_info.mr
	bindAddr   uint64  // bind_mw.bind_info.addr
	bindLength uint64  // bind_mw.bind_info.length
	bindAccess uint32  // bind_mw.bind_info.mw_access_flags
	_          uint32
}

// cRecvWR is struct ibv_recv_wr.
type cRecvWR struct {
	wrID   uint64
	next   uintptr
	sgList uintptr
	numSGE int32
	_      int32
}

// cWC is struct ibv_wc.
type cWC struct {
	wrID         uint64
	status       uint32
	opcode       uint32
	vendorErr    uint32
	byteLen      uint32
	immData      uint32 // network byte order
	qpNum        uint32
	srcQP        uint32
	wcFlags      uint32
	pkeyIndex    uint16
	slid         uint16
	sl           uint8
	dlidPathBits uint8
	_            [2]byte
}

// cQPCap is struct ibv_qp_cap.
type cQPCap struct {
	maxSendWR, maxRecvWR, maxSendSGE, maxRecvSGE, maxInlineData uint32
}

// cQPInitAttr is struct ibv_qp_init_attr.
type cQPInitAttr struct {
	qpContext uintptr
	sendCQ    uintptr
	recvCQ    uintptr
	srq       uintptr
	cap       cQPCap
	qpType    uint32
	sqSigAll  int32
	_         int32
}

// cGlobalRoute is struct ibv_global_route.
type cGlobalRoute struct {
	dgid         [16]byte
	flowLabel    uint32
	sgidIndex    uint8
	hopLimit     uint8
	trafficClass uint8
	_            uint8
}

// cAHAttr is struct ibv_ah_attr.
type cAHAttr struct {
	grh         cGlobalRoute
	dlid        uint16
	sl          uint8
	srcPathBits uint8
	staticRate  uint8
	isGlobal    uint8
	portNum     uint8
	_           uint8
}

// cQPAttr is struct ibv_qp_attr.
type cQPAttr struct {
	qpState          uint32
	curQPState       uint32
	pathMTU          uint32
	pathMigState     uint32
	qkey             uint32
	rqPSN            uint32
	sqPSN            uint32
	destQPNum        uint32
	qpAccessFlags    uint32
	cap              cQPCap
	ahAttr           cAHAttr
	altAHAttr        cAHAttr
	pkeyIndex        uint16
	altPKeyIndex     uint16
	enSQDAsyncNotify uint8
	sqDraining       uint8
	maxRdAtomic      uint8
	maxDestRdAtomic  uint8
	minRNRTimer      uint8
	portNum          uint8
	timeout          uint8
	retryCnt         uint8
	rnrRetry         uint8
	altPortNum       uint8
	altTimeout       uint8
	_                uint8
	rateLimit        uint32
	_                uint32
}

// gidEntryC is struct ibv_gid_entry.
type gidEntryC struct {
	GID     GID
	Index   uint32
	Port    uint32
	Type    uint32
	Ifindex uint32
}
