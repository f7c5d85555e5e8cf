package gdrlink_test

import (
	"context"
	"fmt"

	"github.com/gdrlink/gdrlink"
	"github.com/gdrlink/gdrlink/tensor"
)

// ExampleWithAggregator all-reduces float32 gradients through a SwitchML
// aggregator (cmd/switchml-agg) instead of the ring; the report names the
// backend. It needs the aggregator and the job's other ranks running, so
// it has no output to check.
func ExampleWithAggregator() {
	ctx := context.Background()
	g, err := gdrlink.Join(ctx, gdrlink.WithAggregator("10.0.0.5:4792"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer g.Close()
	grad, err := g.NewTensor(tensor.Float32, 1<<20)
	if err != nil {
		fmt.Println(err)
		return
	}
	rep, err := g.AllReduce(ctx, grad, gdrlink.Average)
	fmt.Println(rep.Backend, rep.Sent, rep.Received, err) // switchml, about 4 MiB each way
}
