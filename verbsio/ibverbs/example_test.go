package ibverbs_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"path/filepath"

	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/ibverbs"
)

// A provider reading a sysfs tree without RDMA devices says so with
// ErrNoDevice, so callers fall back to another provider.
func ExampleNew() {
	p := ibverbs.New(ibverbs.WithSysfsRoot(filepath.Join("testdata", "no-rdma-here")))
	_, err := p.Devices()
	fmt.Println(errors.Is(err, verbsio.ErrNoDevice))
	// Output: true
}

// Opening the device the RDMA_* variables name, and a queue pair on it.
// The endpoint travels to the peer through the bootstrap, which sends back
// the peer's.
func Example_open() {
	cfg, err := verbsio.ConfigFromEnv() // RDMA_DEVICE, RDMA_GID_INDEX, ...
	if err != nil {
		log.Fatal(err)
	}
	dev, err := verbsio.Open(ibverbs.Name, cfg)
	if err != nil {
		log.Fatal(err) // wraps verbsio.ErrNoDevice or verbsio.ErrBadConfig
	}
	defer dev.Close()
	pd, _ := dev.AllocPD()
	defer pd.Close()
	cq, _ := dev.CreateCQ(1024)
	defer cq.Close()
	qp, err := pd.CreateQP(verbsio.QPConfig{SendCQ: cq, RecvCQ: cq})
	if err != nil {
		log.Fatal(err)
	}
	defer qp.Close()
	var peer verbsio.Endpoint // = bootstrap exchange of qp.Endpoint()
	if err := qp.Connect(context.Background(), peer); err != nil {
		log.Fatal(err)
	}
	fmt.Println("connected through", dev.Info().Name)
}
