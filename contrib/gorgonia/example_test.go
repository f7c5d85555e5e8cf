package gorgonia_test

import (
	"context"
	"fmt"
	"log"

	"github.com/gdrlink/gdrlink"
	ggorgonia "github.com/gdrlink/gdrlink/contrib/gorgonia"
	"github.com/gdrlink/gdrlink/tensor"
	gt "gorgonia.org/tensor"
)

// A pool tensor seen as a gorgonia Dense: gorgonia computes in the pool
// memory, which is what gdrlink sends and all-reduces, with no copy.
func ExampleDense() {
	g, err := gdrlink.Join(context.Background(), gdrlink.WithRank(0, 1))
	if err != nil {
		log.Fatal(err)
	}
	defer g.Close()
	w, err := g.NewTensor(tensor.Float32, 2, 2)
	if err != nil {
		log.Fatal(err)
	}
	defer w.Release()
	d, err := ggorgonia.Dense(w)
	if err != nil {
		log.Fatal(err)
	}
	copy(d.Float32s(), []float32{1, 2, 3, 4})
	if _, err := d.Mul(d, gt.UseUnsafe()); err != nil { // squares in place
		log.Fatal(err)
	}
	if _, err := g.AllReduce(context.Background(), w, gdrlink.Average); err != nil {
		log.Fatal(err)
	}
	v, _ := tensor.View[float32](w)
	fmt.Println(d.Shape(), v)
	// Output: (2, 2) [1 4 9 16]
}
