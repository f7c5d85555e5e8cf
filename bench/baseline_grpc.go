package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// The gRPC baseline is how TensorFlow moves tensors by default: a RecvTensor
// RPC whose response carries the tensor's bytes. A real gRPC server runs in
// the peer process on loopback; the client asks for n bytes and copies the
// response into its result tensor, as TensorFlow's gRPC path does. No protoc:
// requests and responses are raw bytes through a codec of our own.

const (
	grpcService = "gdrlink.bench.Tensors"
	grpcMethod  = "/" + grpcService + "/Get"
	// grpcMaxMessage lets a 256 MiB tensor through in one response.
	grpcMaxMessage = 1 << 30
)

// rawCodec sends *[]byte as they are.
type rawCodec struct{}

func (rawCodec) Name() string { return "gdrlink-raw" }

func (rawCodec) Marshal(v any) ([]byte, error) {
	p, ok := v.(*[]byte)
	if !ok {
		return nil, fmt.Errorf("raw codec: cannot marshal %T", v)
	}
	return *p, nil
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	p, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("raw codec: cannot unmarshal into %T", v)
	}
	*p = data
	return nil
}

// grpcServer serves slices of one source buffer.
type grpcServer struct {
	srv *grpc.Server
	ln  net.Listener
	src []byte
	wg  sync.WaitGroup
}

// startGRPCServer listens on loopback and serves requests of up to len(src)
// bytes.
func startGRPCServer(src []byte) (*grpcServer, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &grpcServer{ln: ln, src: src}
	s.srv = grpc.NewServer(grpc.ForceServerCodec(rawCodec{}), grpc.MaxSendMsgSize(grpcMaxMessage), grpc.MaxRecvMsgSize(grpcMaxMessage))
	s.srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: grpcService,
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "Get",
			Handler: func(_ any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				var req []byte
				if err := dec(&req); err != nil {
					return nil, err
				}
				if len(req) != 8 {
					return nil, fmt.Errorf("request of %d bytes, want 8", len(req))
				}
				n := binary.LittleEndian.Uint64(req)
				if n > uint64(len(s.src)) {
					return nil, fmt.Errorf("%d bytes asked, %d available", n, len(s.src))
				}
				out := s.src[:n]
				return &out, nil
			},
		}},
	}, struct{}{})
	s.wg.Add(1)
	go func() { defer s.wg.Done(); _ = s.srv.Serve(ln) }()
	return s, nil
}

func (s *grpcServer) addr() string { return s.ln.Addr().String() }

func (s *grpcServer) close() {
	s.srv.Stop()
	s.wg.Wait()
}

// grpcClient fetches tensors from a grpcServer.
type grpcClient struct {
	cc *grpc.ClientConn
}

func dialGRPC(addr string) (*grpcClient, error) {
	cc, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{}), grpc.MaxCallRecvMsgSize(grpcMaxMessage), grpc.MaxCallSendMsgSize(grpcMaxMessage)))
	if err != nil {
		return nil, err
	}
	return &grpcClient{cc: cc}, nil
}

// get fetches n bytes and copies them into dst (the result tensor).
func (c *grpcClient) get(ctx context.Context, n int, dst []byte) error {
	req := binary.LittleEndian.AppendUint64(nil, uint64(n))
	var resp []byte
	if err := c.cc.Invoke(ctx, grpcMethod, &req, &resp); err != nil {
		return err
	}
	if len(resp) != n {
		return fmt.Errorf("gRPC response of %d bytes, want %d", len(resp), n)
	}
	copy(dst, resp)
	return nil
}

func (c *grpcClient) close() error { return c.cc.Close() }
