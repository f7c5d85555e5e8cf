package tcp_test

import (
	"fmt"

	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/tcp"
)

// Opening a tcp device and reading what it advertises.
func ExampleOpenDevice() {
	dev, err := tcp.OpenDevice(verbsio.Config{ListenAddr: "127.0.0.1:0"}, tcp.Options{Lanes: 2})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer dev.Close()
	c := dev.Caps()
	fmt.Println(c.Provider, "write-with-immediate:", c.WriteWithImmediate, "dma-buf:", c.DMABuf, "max message:", c.MaxMessage)
	// Output: tcp write-with-immediate: true dma-buf: false max message: 1073741824
}
