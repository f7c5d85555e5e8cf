package visitor_test

import (
	"fmt"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

// A pool whose arenas are registered once each with a verbs protection
// domain: every block it hands out already has its keys.
func ExampleNewMemoryRegistration() {
	dev, err := verbsio.Open("tcp", verbsio.Config{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer dev.Close()
	pd, _ := dev.AllocPD()
	defer pd.Close()

	reg := visitor.NewMemoryRegistration(pd, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	pool, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
		alloc.WithVisitors(reg), alloc.WithInitialArena(1<<20))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	regions := map[verbsio.MemoryRegion]bool{}
	for i := 0; i < 100; i++ {
		b, err := pool.Alloc(4096)
		if err != nil {
			fmt.Println(err)
			return
		}
		sge, mr, _ := visitor.SGEOf(pool, b.Addr(), b.Len())
		if i == 0 {
			fmt.Println("lkey matches the arena's region:", sge.LKey == mr.LKey())
		}
		regions[mr] = true
		defer b.Free()
	}
	// 100 blocks, and one registration: the arena's.
	fmt.Println("arenas:", pool.Stats().Arenas, "registrations:", len(regions))
	// Output:
	// lkey matches the arena's region: true
	// arenas: 1 registrations: 1
}
